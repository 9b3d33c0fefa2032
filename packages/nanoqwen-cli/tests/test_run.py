"""`nanoqwen-cli run` through click's CliRunner on a tiny model with the CPU reference backend."""

from __future__ import annotations

import json
import re

import pytest
from nanoqwen_cli import session
from nanoqwen_engine import SamplingParams

PROMPT = "def fib(n):"


def _run(invoke, model, *args, input=None):
    """`nanoqwen-cli run --model MODEL --device cpu ARGS...`."""
    return invoke(["run", "--model", model, "--device", "cpu", *args], input=input)


def _greedy(engine, request, n):
    return engine.complete(request, SamplingParams(temperature=0, max_tokens=n))


def test_raw_greedy_prints_what_the_engine_generates(invoke, tiny_model, tiny_engine):
    result = invoke(["run", "--model", tiny_model, "--device", "cpu", "--raw", "-t", "0", "-n", 12, PROMPT])
    assert result.exit_code == 0, result.output
    want = _greedy(tiny_engine, PROMPT, 12)
    assert result.stdout == want.text + "\n"


def test_prompt_from_stdin_equals_prompt_argument(invoke, tiny_model):
    args = ["run", "--model", tiny_model, "--device", "cpu", "--raw", "-t", "0", "-n", 8, "--quiet"]
    from_arg = invoke([*args, PROMPT])
    from_stdin = invoke(args, input=PROMPT)
    from_dash = invoke([*args, "-"], input=PROMPT)
    from_echo = invoke(args, input=PROMPT + "\n")  # what `echo PROMPT |` sends
    assert from_arg.exit_code == from_stdin.exit_code == from_dash.exit_code == from_echo.exit_code == 0
    assert from_stdin.stdout == from_arg.stdout == from_dash.stdout == from_echo.stdout


def test_chat_template_is_the_default_and_system_reaches_it(invoke, tiny_model, tiny_engine):
    base = ["run", "--model", tiny_model, "--device", "cpu", "-t", "0", "-n", 4, "--json"]
    chat = json.loads(invoke([*base, PROMPT]).stdout)
    raw = json.loads(invoke([*base, "--raw", PROMPT]).stdout)
    system = "You answer in Python only."
    with_system = json.loads(invoke([*base, "--system", system, PROMPT]).stdout)

    user = [{"role": "user", "content": PROMPT}]
    assert chat["prompt_tokens"] == len(tiny_engine.encode_prompt(user))
    assert raw["prompt_tokens"] == len(tiny_engine.encode_prompt(PROMPT))
    assert with_system["prompt_tokens"] == len(
        tiny_engine.encode_prompt([{"role": "system", "content": system}, *user])
    )
    assert chat["text"] == _greedy(tiny_engine, user, 4).text


def test_json_record_shape(invoke, tiny_model, tiny_engine):
    result = invoke(
        ["run", "--model", tiny_model, "--device", "cpu", "--raw", "-t", "0", "-n", 6, "--json", PROMPT]
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, "--json prints exactly one record"
    record = json.loads(lines[0])
    want = _greedy(tiny_engine, PROMPT, 6)
    assert record["text"] == want.text
    assert record["token_ids"] == want.token_ids
    assert record["generated_tokens"] == len(want.token_ids)
    assert record["prompt_tokens"] == len(tiny_engine.encode_prompt(PROMPT))
    assert record["finish_reason"] == want.finish_reason
    assert record["device"] == "cpu" and record["model"] == str(tiny_model)
    for key in ("load_s", "prefill_s", "decode_s"):
        assert isinstance(record[key], float) and record[key] >= 0
    assert result.stderr == "", "--json keeps stderr free of progress and timing lines"


def test_timing_line_on_stderr_and_quiet_silences_it(invoke, tiny_model):
    args = ["run", "--model", tiny_model, "--device", "cpu", "--raw", "-t", "0", "-n", 5, PROMPT]
    loud = invoke(args)
    quiet = invoke([*args, "--quiet"])
    assert loud.exit_code == quiet.exit_code == 0
    assert "tok/s prefill" in loud.stderr and "tok/s decode" in loud.stderr and "load " in loud.stderr
    assert quiet.stderr == ""
    assert loud.stdout == quiet.stdout


def test_stop_string_ends_the_text_before_it(invoke, tiny_model, tiny_engine):
    full = _greedy(tiny_engine, PROMPT, 24).text
    assert len(full) >= 6, f"the tiny model's greedy text is too short to cut: {full!r}"
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    result = _run(invoke, tiny_model, "--raw", "-t", "0", "-n", 24, "--stop", stop, "--json", PROMPT)
    record = json.loads(result.stdout)
    assert record["text"] == full[: full.find(stop)]
    assert record["finish_reason"] == "stop"


def test_seeded_sampling_is_reproducible(invoke, tiny_model):
    args = ["--raw", "-t", "1.0", "--top-k", 50, "-n", 10, "--json", "--seed", 7, PROMPT]
    a = json.loads(_run(invoke, tiny_model, *args).stdout)
    b = json.loads(_run(invoke, tiny_model, *args).stdout)
    assert a["token_ids"] == b["token_ids"]


# -- errors: one `error:` line, non-zero exit, no traceback --


def _one_error_line(result) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_missing_model_file(invoke, tmp_path):
    missing = tmp_path / "nope.nanoqwen"
    line = _one_error_line(invoke(["run", "--model", missing, "--device", "cpu", "--quiet", PROMPT]))
    assert str(missing) in line


def test_not_a_nanoqwen_file(invoke, tmp_path):
    bogus = tmp_path / "bogus.nanoqwen"
    bogus.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    line = _one_error_line(invoke(["run", "--model", bogus, "--device", "cpu", "--quiet", PROMPT]))
    assert "magic" in line.lower() or "nanoqwen" in line.lower()


def test_prompt_too_long(invoke, tiny_model):
    long_prompt = " the" * 200
    line = _one_error_line(_run(invoke, tiny_model, "--raw", "--max-context", 32, "--quiet", long_prompt))
    assert "200" in line and "32" in line


def test_debug_shows_the_exception(invoke, tiny_model):
    from nanoqwen_engine import PromptTooLongError

    result = invoke(["--debug", "run", "--model", tiny_model, "--device", "cpu", "--raw", "--max-context", 32,
                     " the" * 200])
    assert isinstance(result.exception, PromptTooLongError)


def test_empty_prompt_is_refused(invoke, tiny_model):
    line = _one_error_line(invoke(["run", "--model", tiny_model, "--device", "cpu"], input="  \n"))
    assert "empty" in line


@pytest.mark.parametrize("flags", [["--raw", "--system", "x"], ["--top-p", "0"], ["--temperature", "-1"]])
def test_bad_flag_combinations_are_usage_errors(invoke, tiny_model, flags):
    result = invoke(["run", "--model", tiny_model, "--device", "cpu", *flags, PROMPT])
    assert result.exit_code == 2
    assert "Traceback" not in result.output


# -- flag values checked against the model before anything loads --


@pytest.fixture
def no_engine_load(monkeypatch):
    from nanoqwen_engine import Engine

    def refuse(*args, **kwargs):
        raise AssertionError("Engine.load must not run for a bad flag")

    monkeypatch.setattr(Engine, "load", refuse)


@pytest.mark.parametrize("value", [40000, 1_000_000_000])
def test_max_context_beyond_the_model_is_a_usage_error(invoke, tiny_model, no_engine_load, value):
    result = invoke(["run", "--model", tiny_model, "--device", "cpu", "--max-context", value, PROMPT])
    assert result.exit_code == 2, result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: Invalid value for '--max-context'") and "1..32768" in last, last


def test_max_context_beyond_free_gpu_memory_is_a_usage_error(monkeypatch):
    import click
    from nanoqwen_cli import bandwidth
    from nanoqwen_format.synthetic import qwen7b_config

    config = qwen7b_config()
    per_token = bandwidth.kv_bytes_per_token(config)
    weights = 4_500_000_000
    monkeypatch.setattr(session, "gpu_free_bytes", lambda: weights + 1000 * per_token)
    session.check_max_context(1000, config, "cuda", weights)  # fits exactly
    with pytest.raises(click.BadParameter, match=r"accepted range here is 1\.\.1000\b"):
        session.check_max_context(1001, config, "cuda", weights)
    session.check_max_context(32768, config, "cpu", weights)  # the CPU reference maps KV lazily


def test_max_tokens_beyond_the_context_is_capped_with_a_note(invoke, tiny_model, tiny_engine):
    args = ["run", "--model", tiny_model, "--device", "cpu", "--raw", "-t", "0", "--max-context", 48]
    result = invoke([*args, "-n", 1_000_000_000, "--json", PROMPT])
    assert result.exit_code == 0, result.output
    n_prompt = len(tiny_engine.encode_prompt(PROMPT))
    assert f"note: --max-tokens 1000000000 capped at {48 - n_prompt}" in result.stderr
    record = json.loads(result.stdout)
    assert record["generated_tokens"] <= 48 - n_prompt


def test_seed_minus_one_draws_a_seed_and_reports_it(invoke, tiny_model):
    args = ["run", "--model", tiny_model, "--device", "cpu", "--raw", "-t", "1.0", "-n", 6, PROMPT]
    result = invoke([*args, "--seed", -1])
    assert result.exit_code == 0, result.output
    (seed,) = re.findall(r"\| seed (\d+)$", result.stderr, re.M)
    replay = json.loads(invoke([*args, "--seed", seed, "--json"]).stdout)
    first = json.loads(invoke([*args, "--seed", -1, "--json"]).stdout)
    assert isinstance(first["seed"], int) and replay["seed"] == int(seed)
    # raw bytes: click's Result.stdout turns "\r\n" into "\n", and a sampled token may end in "\r\n"
    assert (replay["text"] + "\n").encode() == result.stdout_bytes, "the reported seed replays the answer"
    greedy = invoke(["run", "--model", tiny_model, "--device", "cpu", "--raw", "-t", "0", "-n", 3, PROMPT])
    assert "seed" not in greedy.stderr, "greedy decoding has no seed to report"
