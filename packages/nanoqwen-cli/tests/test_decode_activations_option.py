"""--decode-activations on run, chat, verify, serve and bench: passed to Engine.load only when given, and a
clear error where the device has no such choice (the CPU reference computes in float32). Its --help on each
command is checked with --lm-head-dtype's (test_lm_head_option.py)."""

from __future__ import annotations

import pytest


def activations(engine_loads) -> list:
    """Each Engine.load's decode_activations, "absent" where the keyword was not passed (conftest.engine_loads)."""
    return [k.get("decode_activations", "absent") for k in engine_loads]


@pytest.mark.parametrize("command, args, stdin", [
    ("run", ["--raw", "-t", "0", "-n", "2", "--json", "def"], None),
    ("chat", ["-t", "0", "-n", "2"], "hi\n/bye\n"),
])
def test_the_option_reaches_engine_load_only_when_given(invoke, tiny_model, engine_loads, command, args, stdin):
    """fp16 (what the reference computes, so accepted on the CPU) reaches Engine.load; without the flag it
    gets None (the engine's default: $NANOQWEN_DECODE_ACTIVATIONS, else int8 on the GPU)."""
    for flag, want in ((["--decode-activations", "fp16"], "fp16"), ([], None)):
        result = invoke([command, "--model", tiny_model, "--device", "cpu", *flag, *args], input=stdin)
        assert result.exit_code == 0, result.output
        assert activations(engine_loads) == [want], activations(engine_loads)
        engine_loads.clear()


def test_int8_on_the_cpu_is_one_clear_error(invoke, tiny_model):
    result = invoke(["run", "--model", tiny_model, "--device", "cpu", "--decode-activations", "int8", "hi"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "decode_activations applies to device='cuda' only" in result.output


def test_verify_gives_the_option_to_the_engine_under_test_only(invoke, tiny_model, engine_loads):
    """The reference has no decode activations to choose; the engine under test gets the flag."""
    result = invoke(["verify", "--model", tiny_model, "--device", "cpu", "--max-tokens", 2, "--max-prompt-tokens",
                     30, "--prompts", 1, "--score-prompts", 0, "--json", "--decode-activations", "fp16"])
    assert result.exit_code == 0, result.output
    assert activations(engine_loads) == ["absent", "fp16"]
