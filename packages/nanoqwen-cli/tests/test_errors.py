"""How failures reach the user: errors.describe() for foreign exceptions, and the group's exit codes."""

from __future__ import annotations

import errno

import pytest
from nanoqwen_cli import session
from nanoqwen_cli.errors import describe
from nanoqwen_engine import ModelFormatError, NoGPUError
from nanoqwen_format import NanoqwenFormatError
from nanoqwen_kernels import KernelError


def _named(name: str, base=Exception):
    """An exception class named like a foreign library's (huggingface_hub, cupy) without importing it."""
    return type(name, (base,), {})


@pytest.mark.parametrize(
    ("exc", "words"),
    [
        (_named("OfflineModeIsEnabled")("cannot reach the hub"), ["offline", "cannot reach the hub"]),
        (_named("RepositoryNotFoundError")("404 acme/nope"), ["no such model", "acme/nope"]),
        (
            _named("OutOfMemoryError")("out of memory allocating 1,073,741,824 bytes"),
            ["GPU memory", "--max-context"],
        ),
        (MemoryError(), ["out of memory"]),
        (
            FileNotFoundError(errno.ENOENT, "No such file", "/x/y.nanoqwen"),
            ["file not found", "/x/y.nanoqwen"],
        ),
        (PermissionError(errno.EACCES, "Permission denied", "/root/m"), ["permission denied", "/root/m"]),
        (OSError(errno.ENOSPC, "No space left on device", "/tmp/c"), ["no space left", "/tmp/c"]),
        (NoGPUError("no usable GPU: none"), ["no usable GPU: none", "--device cpu", "Qwen2.5-Coder-1.5B"]),
        (_named("NoGPUError")("look-alike"), ["unexpected NoGPUError"]),  # matched by type, not by name
        (ModelFormatError("/m.nanoqwen: bad magic"), ["/m.nanoqwen: bad magic"]),
        (NanoqwenFormatError("tensor x: CRC32 mismatch"), ["tensor x: CRC32 mismatch"]),
        (KernelError("unsupported head_dim 64"), ["unsupported head_dim 64"]),
        (ValueError("first line\nsecond line"), ["unexpected ValueError: first line", "--debug"]),
    ],
)
def test_describe_names_the_problem_on_one_line(exc, words):
    line = describe(exc)
    assert "\n" not in line
    for word in words:
        assert word in line, (word, line)
    if isinstance(exc, ModelFormatError | NanoqwenFormatError | KernelError):
        assert line == str(exc), "our own messages are printed as they are"


def test_unexpected_exception_is_one_line_exit_1(invoke, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(session, "load", boom)
    result = invoke(["run", "--device", "cpu", "hi"])
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        "error: unexpected RuntimeError: kaboom (rerun with `nanoqwen-cli --debug ...` for the traceback)"
    )
    debug = invoke(["--debug", "run", "--device", "cpu", "hi"])
    assert isinstance(debug.exception, RuntimeError)


def test_ctrl_c_in_run_exits_130_quietly(invoke, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(session, "load", interrupted)
    result = invoke(["run", "--device", "cpu", "hi"])
    assert result.exit_code == 130
    assert "Traceback" not in result.output and "interrupted" in result.stderr


def test_unknown_command_is_a_usage_error(invoke):
    result = invoke(["frobnicate"])
    assert result.exit_code == 2 and "No such command" in result.stderr


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--temperature", "nan"], ["'--temperature'", "finite", "x>=0"]),
        (["--temperature", "inf"], ["'--temperature'", "finite"]),
        (["--top-p", "nan"], ["'--top-p'", "0<x<=1"]),
        (["--seed", "-2"], ["'--seed'", "-1<=x"]),
        (["--max-tokens", "0"], ["'--max-tokens'", "x>=1"]),
        (["--max-context", "0"], ["'--max-context'", "x>=1"]),
    ],
)
def test_bad_flag_values_are_usage_errors_before_any_load(invoke, monkeypatch, flags, words):
    def no_load(*args, **kwargs):
        raise AssertionError("nothing is loaded for a bad flag")

    monkeypatch.setattr(session, "load", no_load)
    result = invoke(["run", "--device", "cpu", *flags, "hi"])
    assert result.exit_code == 2, result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: Invalid value"), result.stderr
    for word in words:
        assert word in last, (word, last)


@pytest.mark.parametrize("flag", ["--prefill-chunk", "--prefill-chunk-idle"])
def test_serve_refuses_a_prefill_budget_below_one_before_loading(invoke, flag):
    """serve's per-step prompt budgets (beside decoding rows, and with none decoding) are checked by the
    option parser: a usage error naming the flag, no model touched, no port bound."""
    result = invoke(["serve", "--model", "/nonexistent/model.nanoqwen", "--device", "cpu", flag, 0])
    assert result.exit_code == 2 and flag in result.output


def test_serve_refuses_int8_decode_on_the_cpu_before_binding(invoke, tiny_model):
    """serve --decode-activations int8 on the CPU reference: one line from the engine, before any port."""
    result = invoke(["serve", "--model", tiny_model, "--device", "cpu", "--port", "0", "--decode-activations", "int8"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "decode_activations applies to device='cuda' only" in result.output


def test_serve_refuses_fp8_prefill_on_the_cpu_before_binding(invoke, tiny_model):
    """serve --prefill-weights fp8 on the CPU reference: the engine refuses it with one line, exit non-zero,
    before any port is bound."""
    result = invoke(["serve", "--model", tiny_model, "--device", "cpu", "--port", "0", "--prefill-weights", "fp8"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "prefill_weights applies to device='cuda' only" in result.output
