"""nanoqwen-cli end to end, as real subprocesses (`python -m nanoqwen_cli`), on a tiny synthetic model.

What a user sees: text streamed in several writes while the process runs, a prompt on stdin, one JSON
record, a chat driven through stdin (and Ctrl-C), convert + inspect, bench, and one `error:` line with a
non-zero exit for each failure a user will meet. Everything runs on the CPU reference backend.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest
from nanoqwen_cli.testing import TIMEOUT, cli, popen


def one_error_line(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    return lines[0]


# -- run --


def test_run_streams_text_in_several_writes_while_running(tiny_model, env):
    args = ["run", "--model", tiny_model, "--device", "cpu", "--raw", "-t", "0", "-n", 40, "def fib(n):"]
    proc = popen(args, env)
    chunks = []  # (bytes, process still running when they arrived)
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        data = os.read(proc.stdout.fileno(), 1 << 16)
        if not data:
            break
        chunks.append((data, proc.poll() is None))
    proc.wait(timeout=TIMEOUT)
    stderr = proc.stderr.read().decode()
    assert proc.returncode == 0, stderr
    live = [c for c, running in chunks if running]
    assert len(live) >= 3, (
        f"expected the answer in several writes while the process ran, got {len(chunks)} chunks"
    )

    whole = cli([*args[:-1], "--json", "def fib(n):"], env)
    assert b"".join(c for c, _ in chunks).decode() == json.loads(whole.stdout)["text"] + "\n"
    assert re.search(r"generated \d+ tokens, ([\d.,]+|n/a) tok/s decode", stderr)


def test_run_prompt_from_stdin(tiny_model, env):
    args = ["run", "--model", tiny_model, "--device", "cpu", "--raw", "-t", "0", "-n", 8, "--quiet"]
    piped = cli(args, env, input="def fib(n):")
    given = cli([*args, "def fib(n):"], env)
    assert piped.returncode == given.returncode == 0, piped.stderr
    assert piped.stdout == given.stdout and piped.stdout.strip()
    assert piped.stderr == ""


def test_run_json_record(tiny_model, env):
    p = cli(["run", "--model", tiny_model, "--device", "cpu", "-t", "0", "-n", 6, "--json", "hello"], env)
    assert p.returncode == 0, p.stderr
    (line,) = p.stdout.strip().splitlines()
    r = json.loads(line)
    expected = {
        "text",
        "finish_reason",
        "prompt_tokens",
        "generated_tokens",
        "token_ids",
        "load_s",
        "prefill_s",
        "decode_s",
        "prefill_tok_s",
        "decode_tok_s",
        "model",
        "model_path",
        "device",
    }
    assert expected <= set(r)
    assert r["generated_tokens"] == len(r["token_ids"]) and 1 <= r["generated_tokens"] <= 6
    assert r["finish_reason"] in ("stop", "length") and r["device"] == "cpu"
    assert r["prompt_tokens"] > 1 and r["prefill_s"] > 0


# -- chat --


def _prompt_tokens(stderr: str) -> list[int]:
    return [int(n) for n in re.findall(r"prompt (\d+) tokens", stderr)]


def test_chat_through_stdin_with_reset_and_exit(tiny_model, env):
    script = "hello\nand then?\n/reset\nhello\n/exit\nthis line is never read\n"
    p = cli(["chat", "--model", tiny_model, "--device", "cpu", "-t", "0", "-n", 5], env, input=script)
    assert p.returncode == 0, p.stderr
    first, second, third = _prompt_tokens(p.stderr)
    assert second > first and third == first
    # stdout is a1 \n a2 \n a1 \n (after /reset the same question gets the same greedy answer); an
    # answer may hold newlines itself, so try every newline as the end of a1.
    out = p.stdout
    firsts = [out[:i] for i, ch in enumerate(out) if ch == "\n"]
    assert any(out.endswith("\n" + a + "\n") and len(out) >= 2 * len(a) + 3 for a in firsts), out


def test_chat_ctrl_c_stops_the_answer_not_the_session(tiny_model, env):
    # -n 300 bounds each answer (finish "length") so the second turn ends by itself, and makes the first
    # one last seconds on the CPU: the SIGINT below lands while it is still streaming.
    proc = popen(
        ["chat", "--model", tiny_model, "--device", "cpu", "-t", "0", "--max-context", 512, "-n", 300],
        env,
        stdin=subprocess.PIPE,
    )
    proc.stdin.write(b"hello\n")
    proc.stdin.flush()
    first = os.read(proc.stdout.fileno(), 1 << 16)  # the answer has started
    assert first
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(b"/reset\nhi\n/exit\n", timeout=TIMEOUT)
    err = err.decode()
    assert proc.returncode == 0, err
    assert "(answer stopped)" in err
    assert len(_prompt_tokens(err)) == 1, "the turn after Ctrl-C is answered to its end"


# -- convert, inspect, bench --


def test_convert_and_inspect_a_synthetic_hf_folder(tmp_path, env):
    from nanoqwen_format.synthetic import tiny_config, write_hf_checkpoint

    config = tiny_config(tie_word_embeddings=True)
    write_hf_checkpoint(tmp_path / "hf-model", config, seed=5, shards=2)
    out = tmp_path / "out.nanoqwen"
    conv = cli(["convert", tmp_path / "hf-model", "-o", out, "--quiet"], env)
    assert conv.returncode == 0, conv.stderr
    assert out.is_file()
    shown = cli(["inspect", out, "--json", "--verify"], env)
    assert shown.returncode == 0, shown.stderr
    header = json.loads(shown.stdout)
    assert header["config"]["tie_word_embeddings"] is True
    assert header["config"]["num_hidden_layers"] == config["num_hidden_layers"]
    run_args = ["--device", "cpu", "--raw", "-t", "0", "-n", 3, "--json", "x = "]
    from_file = cli(["run", "--model", out, *run_args], env)
    assert from_file.returncode == 0, from_file.stderr

    # --model with the HF folder itself: converted once into $NANOQWEN_CACHE, then reused.
    args = ["run", "--model", tmp_path / "hf-model", *run_args]
    first = cli(args, env)
    assert first.returncode == 0, first.stderr
    (cached,) = (tmp_path / "cache").glob("*.nanoqwen")
    mtime = cached.stat().st_mtime_ns
    second = cli(args, env)
    assert second.returncode == 0, second.stderr
    assert cached.stat().st_mtime_ns == mtime and len(list((tmp_path / "cache").glob("*.nanoqwen"))) == 1
    assert (
        json.loads(first.stdout)["text"]
        == json.loads(second.stdout)["text"]
        == json.loads(from_file.stdout)["text"]
    )


def test_bench_synthetic_tiny_json(env):
    p = cli(
        [
            "bench",
            "--device",
            "cpu",
            "--synthetic",
            "tiny",
            "--prompt-tokens",
            16,
            "--gen-tokens",
            4,
            "--runs",
            2,
            "--warmup",
            1,
            "--json",
        ],
        env,
    )
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    for key in (
        "decode_ms_per_token",
        "prefill_ms",
        "gpu_name",
        "mode",
        "runs",
        "achieved_gbs",
        "pct_of_copy_bw",
        "bytes_per_token",
        "peak_gpu_mem_bytes",
    ):
        assert key in r, key
    assert len(r["runs"]) == 2 and all(run["prompt_tokens"] == 16 for run in r["runs"])
    assert r["decode_ms_per_token"] > 0 and r["achieved_gbs"] > 0
    assert r["mode"] == "reference"


def test_verify_reference_against_itself(tiny_model, env):
    p = cli(
        [
            "verify",
            "--model",
            tiny_model,
            "--device",
            "cpu",
            "--prompts",
            2,
            "--max-tokens",
            3,
            "--max-prompt-tokens",
            20,
            "--score-prompts",
            1,
            "--json",
        ],
        env,
    )
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["ok"] and r["n_exact"] == 2 and r["max_logit_rel_err"] == 0.0


def test_help_everywhere(env):
    top = cli(["--help"], env)
    assert top.returncode == 0
    for command in ("run", "chat", "convert", "inspect", "bench", "verify"):
        assert command in top.stdout
        sub = cli([command, "--help"], env)
        assert sub.returncode == 0 and f"nanoqwen-cli {command}" in sub.stdout, command


# -- errors a user will meet --


def test_error_missing_file(tmp_path, env):
    missing = tmp_path / "missing.nanoqwen"
    line = one_error_line(cli(["run", "--model", missing, "--device", "cpu", "hi"], env))
    assert str(missing) in line


def test_error_not_a_nanoqwen_file(tmp_path, env):
    bogus = tmp_path / "model.nanoqwen"
    bogus.write_bytes(os.urandom(10000))
    line = one_error_line(cli(["run", "--model", bogus, "--device", "cpu", "hi"], env))
    assert str(bogus) in line


def test_error_prompt_too_long(tiny_model, env):
    line = one_error_line(
        cli(
            ["run", "--model", tiny_model, "--device", "cpu", "--raw", "--max-context", 32, " the" * 100], env
        )
    )
    assert "100" in line and "32" in line


def test_error_hub_id_offline_with_empty_cache(env):
    line = one_error_line(cli(["run", "--device", "cpu", "hi"], env))  # the default model is a hub id
    assert "Qwen/Qwen2.5-Coder-7B-Instruct" in line


def test_error_cuda_without_a_gpu(tiny_model, env):
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU visible, on any machine
    line = one_error_line(cli(["run", "--model", tiny_model, "--device", "cuda", "hi"], env))
    assert "GPU" in line and "--device cpu --model Qwen/Qwen2.5-Coder-1.5B-Instruct" in line, line
    # The defaults (hub model, cuda): the missing GPU is reported before any download is tried.
    assert "GPU" in one_error_line(cli(["run", "hi"], env))


def test_debug_shows_the_traceback(tmp_path, env):
    p = cli(["--debug", "run", "--model", tmp_path / "missing.nanoqwen", "--device", "cpu", "hi"], env)
    assert p.returncode != 0 and "Traceback" in p.stderr


def test_bench_without_a_gpu_fails_before_writing_anything(env, tmp_path):
    env["CUDA_VISIBLE_DEVICES"] = ""
    line = one_error_line(cli(["bench", "--synthetic", "7b"], env))
    assert "GPU" in line and "--device cpu" in line
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_closed_stdout_ends_quietly(tiny_model, env):
    # `nanoqwen-cli run ... | head -c 5`: the reader goes away; no traceback, the shell's SIGPIPE status.
    proc = popen(
        ["run", "--model", tiny_model, "--device", "cpu", "--raw", "-t", "0", "-n", 300, "def f(x):"], env
    )
    assert os.read(proc.stdout.fileno(), 5)
    proc.stdout.close()
    proc.wait(timeout=TIMEOUT)
    stderr = proc.stderr.read().decode()
    assert proc.returncode == 141, stderr
    assert "Traceback" not in stderr and "error" not in stderr


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (["--temperature", "nan"], "'--temperature'"),
        (["--seed", "-7"], "'--seed'"),
        (["-n", "0"], "'--max-tokens'"),
    ],
)
def test_bad_flag_values_are_usage_errors(env, flags, flag):
    p = cli(["run", "--device", "cpu", *flags, "hi"], env)  # the default hub model: nothing is fetched
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith(f"error: Invalid value for {flag}"), p.stderr


def test_top_level_help_shows_how_to_get_a_model_and_completion(env):
    top = cli(["--help"], env)
    assert top.returncode == 0
    for text in (
        "nanoqwen-cli pull Qwen/Qwen2.5-Coder-1.5B-Instruct",
        "--device cpu",
        "_NANOQWEN_CLI_COMPLETE",
    ):
        assert text in top.stdout, text
    assert "tiny.nanoqwen" not in top.stdout, "no example names a file that nothing makes"


@pytest.mark.parametrize(
    ("words", "want"), [("nanoqwen-cli ch", "plain,chat"), ("nanoqwen-cli run --dev", "plain,--device")]
)
def test_shell_completion(env, words, want):
    env = {
        **env,
        "_NANOQWEN_CLI_COMPLETE": "bash_complete",
        "COMP_WORDS": words,
        "COMP_CWORD": str(len(words.split()) - 1),
    }
    p = cli([], env)
    assert p.returncode == 0, p.stderr
    assert want in p.stdout.splitlines(), p.stdout
