"""--lm-head-dtype: on every command that loads a model for inference, documented in --help, passed to
Engine.load (verify: to both of its engines), and counted by bench's bytes per token. The numerics flags'
--help (this one and --decode-activations) and their choices against the engine's are checked here for
both (test_decode_activations_option.py has the rest of --decode-activations)."""

from __future__ import annotations

import json

import pytest
from nanoqwen_format import open_model

LOADING_COMMANDS = ("run", "chat", "perplexity", "verify", "serve", "bench")


def heads(engine_loads) -> list:
    """Each Engine.load's lm_head_dtype, in order (conftest.engine_loads records their keyword arguments)."""
    return [k.get("lm_head_dtype") for k in engine_loads]


# flag as --help shows it, the commands that take it, what its help must say
NUMERICS_FLAGS = [
    ("--lm-head-dtype [int8|fp16]", LOADING_COMMANDS,
     ("default: $NANOQWEN_LM_HEAD_DTYPE, else int8", "one fp16 scale per 128 values", "the file's values")),
    ("--decode-activations [fp16|int8]", ("run", "chat", "verify", "serve", "bench"),
     ("default: $NANOQWEN_DECODE_ACTIVATIONS, else int8", "a scale per 16 values", "fp16 (the activation as it is")),
]


@pytest.mark.parametrize("flag, command, words", [(f, c, w) for f, cs, w in NUMERICS_FLAGS for c in cs])
def test_help_explains_the_option(invoke, flag, command, words):
    """Each command lists the flag with its choices, its default and where the default comes from."""
    result = invoke([command, "--help"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert flag in text and all(w in text for w in words), (command, flag)


@pytest.mark.parametrize("command, args", [
    ("run", ["--raw", "-t", "0", "-n", "2", "--json", "def"]),
    ("perplexity", ["--window", "16", "--json"]),
    ("chat", ["-t", "0", "-n", "2"]),
])
def test_the_option_reaches_engine_load(invoke, tiny_model, tmp_path, engine_loads, command, args):
    """--lm-head-dtype fp16 is what Engine.load gets; without the flag it gets None (the engine's default,
    $NANOQWEN_LM_HEAD_DTYPE else int8)."""
    text = tmp_path / "a.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 4, encoding="utf-8")
    extra = [text] if command == "perplexity" else []
    stdin = "hi\n/bye\n" if command == "chat" else None
    for flag, want in ((["--lm-head-dtype", "fp16"], "fp16"), ([], None)):
        result = invoke([command, "--model", tiny_model, "--device", "cpu", *flag, *args, *extra], input=stdin)
        assert result.exit_code == 0, result.output
        assert heads(engine_loads) == [want], heads(engine_loads)
        engine_loads.clear()


def test_verify_gives_both_engines_the_same_head(invoke, tiny_model, engine_loads):
    """verify loads the CPU reference and the engine under test: both get --lm-head-dtype (the reference
    must multiply the values the device does)."""
    result = invoke(["verify", "--model", tiny_model, "--device", "cpu", "--max-tokens", 2, "--max-prompt-tokens",
                     30, "--prompts", 1, "--score-prompts", 0, "--json", "--lm-head-dtype", "fp16"])
    assert result.exit_code == 0, result.output
    assert heads(engine_loads) == ["fp16", "fp16"]


def test_serve_passes_the_option(invoke, tiny_model, engine_loads):
    engine_loads.stop = True
    result = invoke(["serve", "--model", tiny_model, "--device", "cpu", "--port", 0, "--lm-head-dtype", "int8"])
    assert result.exit_code != 0 and "stopped by the test" in result.output
    assert heads(engine_loads) == ["int8"]


def test_bench_counts_the_head_as_stored(invoke):
    """bench --lm-head-dtype fp16 loads the fp16 head (engine_info says so) and counts its 2 bytes a value;
    the default int8 head is V x H bytes plus an fp16 scale per 128 values less."""
    small = ["--device", "cpu", "--prompt-tokens", 8, "--gen-tokens", 2, "--runs", 1, "--warmup", 0, "--json"]
    fp16 = json.loads(invoke(["bench", "--synthetic", "tiny", *small, "--lm-head-dtype", "fp16"]).stdout)
    int8 = json.loads(invoke(["bench", "--synthetic", "tiny", *small]).stdout)
    assert fp16["engine_info"]["lm_head_dtype"] == "fp16" and int8["engine_info"]["lm_head_dtype"] == "int8"
    config = open_model(fp16["model_path"]).config
    v, h = config["vocab_size"], config["hidden_size"]
    assert fp16["weight_bytes_per_token"] - int8["weight_bytes_per_token"] == 2 * v * h - (v * h + 2 * v * h // 128)


def test_an_unknown_value_is_a_usage_error(invoke, tiny_model):
    result = invoke(["run", "--model", tiny_model, "--device", "cpu", "--lm-head-dtype", "bf16", "hi"])
    assert result.exit_code == 2 and "int8" in result.output and "fp16" in result.output


def test_the_flags_choices_are_the_engines():
    """options.py restates the engine's choices (it does not import the engine, so --help stays fast): the
    lists must not drift apart."""
    from nanoqwen_cli.options import decode_activations_option, lm_head_dtype_option
    from nanoqwen_engine.engine import DECODE_ACTIVATIONS
    from nanoqwen_engine.lm_head import LM_HEAD_DTYPES

    def choices(option):
        return tuple(option(lambda: None).__click_params__[0].type.choices)

    assert choices(lm_head_dtype_option) == LM_HEAD_DTYPES
    assert choices(decode_activations_option) == DECODE_ACTIVATIONS
