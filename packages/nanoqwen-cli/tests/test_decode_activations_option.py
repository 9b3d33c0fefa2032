"""--decode-activations: on every command that decodes on the GPU (run, chat, verify, serve, bench),
documented in --help with its default, passed to Engine.load only when given, and a clear error where the
device has no such choice (the CPU reference computes in float32)."""

from __future__ import annotations

import pytest
from nanoqwen_engine import Engine

COMMANDS = ("run", "chat", "verify", "serve", "bench")


@pytest.fixture
def load_calls(monkeypatch):
    """Every Engine.load's decode_activations (absent: the string "absent"), in order; the loads go on."""
    calls = []
    load = Engine.load

    def spy(path, *args, **kwargs):
        calls.append(kwargs.get("decode_activations", "absent"))
        return load(path, *args, **kwargs)

    monkeypatch.setattr(Engine, "load", spy)
    return calls


@pytest.mark.parametrize("command", COMMANDS)
def test_help_explains_the_option(invoke, command):
    result = invoke([command, "--help"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "--decode-activations [fp16|int8]" in text
    for words in ("default: $NANOQWEN_DECODE_ACTIVATIONS, else int8", "a scale per 16 values", "fp16 (the activation as it is"):
        assert words in text, (command, words)


@pytest.mark.parametrize("command, args, stdin", [
    ("run", ["--raw", "-t", "0", "-n", "2", "--json", "def"], None),
    ("chat", ["-t", "0", "-n", "2"], "hi\n/bye\n"),
])
def test_the_option_reaches_engine_load_only_when_given(invoke, tiny_model, load_calls, command, args, stdin):
    """fp16 (what the reference computes, so accepted on the CPU) reaches Engine.load; without the flag
    nothing is passed and the engine's default applies."""
    for flag, want in ((["--decode-activations", "fp16"], "fp16"), ([], "absent")):
        result = invoke([command, "--model", tiny_model, "--device", "cpu", *flag, *args], input=stdin)
        assert result.exit_code == 0, result.output
        assert load_calls == [want], load_calls
        load_calls.clear()


def test_int8_on_the_cpu_is_one_clear_error(invoke, tiny_model):
    result = invoke(["run", "--model", tiny_model, "--device", "cpu", "--decode-activations", "int8", "hi"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "decode_activations applies to device='cuda' only" in result.output


def test_verify_gives_the_option_to_the_engine_under_test_only(invoke, tiny_model, load_calls):
    """The reference has no decode activations to choose; the engine under test gets the flag."""
    result = invoke(["verify", "--model", tiny_model, "--device", "cpu", "--max-tokens", 2, "--max-prompt-tokens",
                     30, "--prompts", 1, "--score-prompts", 0, "--json", "--decode-activations", "fp16"])
    assert result.exit_code == 0, result.output
    assert load_calls == ["absent", "fp16"]
