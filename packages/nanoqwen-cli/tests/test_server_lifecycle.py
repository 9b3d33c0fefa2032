"""`nanoqwen-cli serve` over a request's and the process's life: 503 while loading, a client that leaves
frees its pages, many concurrent clients, SIGTERM drains (bounded) and exits 0, and the load generator
(scripts/load_openai.py) against a real server.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
from nanoqwen_cli.testing import argv
from nanoqwen_engine import SamplingParams

REPO = Path(__file__).resolve().parents[3]
USER = [{"role": "user", "content": "def fib(n):"}]


def _cancelled(m: dict) -> float:
    return m.get('nanoqwen_requests_finished_total{finish_reason="cancelled"}', 0.0)


def _wait_for(cond, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_streaming_client_that_leaves_frees_its_pages(server):
    before = server.wait_idle()
    stream = server.client().completions.create(model="tiny", prompt="x", max_tokens=3000, stream=True,
                                                extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    assert server.metrics()["nanoqwen_kv_pages_used"] > 0
    stream.close()  # the client goes away mid-stream
    _wait_for(lambda: _cancelled(server.metrics()) == _cancelled(before) + 1)
    after = server.wait_idle()
    assert after["nanoqwen_kv_pages_used"] == 0
    assert after["nanoqwen_kv_pages_free"] == after["nanoqwen_kv_pages_total"]
    generated = after["nanoqwen_generation_tokens_total"] - before["nanoqwen_generation_tokens_total"]
    assert 2 <= generated < 3000, "the request ended when its client left, not at max_tokens"


def test_non_streaming_client_that_leaves_frees_its_pages(server):
    before = server.wait_idle()
    conn = server.connect(timeout=1.0)
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 3000, "ignore_eos": True})
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    try:
        conn.getresponse()
        raise AssertionError("3000 tokens on the CPU cannot come back within the client's 1 s timeout")
    except TimeoutError:
        pass
    conn.close()
    _wait_for(lambda: _cancelled(server.metrics()) == _cancelled(before) + 1)
    after = server.wait_idle()
    assert after["nanoqwen_kv_pages_used"] == 0
    assert after["nanoqwen_generation_tokens_total"] - before["nanoqwen_generation_tokens_total"] < 3000


def test_32_concurrent_streaming_clients(server, tiny_engine, rng):
    """40 streamed requests, 32 at a time (chat and completions, prompts of 1..~100 tokens): every one
    completes with its exact token count, and the pool ends with every page free. (Greedy: the CPU
    sampler's top-p sort over the 152k vocabulary would make each step many times slower.)"""
    words = ["def", "return", "x", "for", "in", "range", "if", "else", "(", ")", ":", "+", "1"]
    jobs = []
    for i in range(40):
        text = " ".join(rng.choice(words, size=rng.choice([1, 8, 30, 100])))
        jobs.append((i % 2 == 0, text, int(rng.integers(1, 5))))

    async def one(client, sem, chat, text, n):
        async with sem:
            common = {"model": "tiny", "max_tokens": n, "temperature": 0, "stream": True,
                      "stream_options": {"include_usage": True}, "extra_body": {"ignore_eos": True}}
            if chat:
                stream = await client.chat.completions.create(
                    messages=[{"role": "user", "content": text}], **common)
            else:
                stream = await client.completions.create(prompt=text, **common)
            chunks = [c async for c in stream]
            return chunks[-2].choices[0].finish_reason, chunks[-1].usage

    async def go():
        async with server.async_client(timeout=600) as client:
            sem = asyncio.Semaphore(32)
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, sem, *job) for job in jobs)), timeout=600)

    results = asyncio.run(go())
    for (chat, text, n), (finish, use) in zip(jobs, results, strict=True):
        prompt = [{"role": "user", "content": text}] if chat else text
        assert finish == "length"
        assert use.completion_tokens == n
        assert use.prompt_tokens == len(tiny_engine.encode_prompt(prompt))
    m = server.wait_idle()
    assert m["nanoqwen_kv_pages_used"] == 0
    assert m["nanoqwen_kv_pages_free"] == m["nanoqwen_kv_pages_total"]


def test_batched_greedy_requests_equal_the_engine_one_at_a_time(server, tiny_engine):
    """Requests decoded in one batch get each the tokens the engine gives them alone."""
    prompts = ["def fib(n):", "class Stack:", "import numpy as np\n", "for i in range(10):"]
    want = [tiny_engine.complete(p, SamplingParams(temperature=0, max_tokens=8)).text for p in prompts]

    async def go():
        async with server.async_client() as client:
            return await asyncio.gather(*(client.completions.create(model="tiny", prompt=p, temperature=0,
                                                                    max_tokens=8) for p in prompts * 2))

    got = asyncio.run(go())
    assert [g.choices[0].text for g in got] == want * 2


def test_loading_503_then_sigterm_drains_in_flight_and_exits_0(tiny_model, tmp_path):
    """503 (code model_loading) until the model is loaded; on SIGTERM the listening socket closes at
    once, a short request in flight finishes whole, a long one is cancelled after --drain-timeout with
    an error event, exit 0."""
    from server_process import ServeProcess

    proc = ServeProcess(tiny_model, tmp_path, "--served-model-name", "tiny", "--drain-timeout", "5")
    try:
        health = proc.request("GET", "/health")
        early = proc.request("POST", "/v1/chat/completions", {"model": "tiny", "messages": USER})
        assert health.status == 503 and health.json()["error"]["code"] == "model_loading"
        assert early.status == 503 and early.json()["error"]["code"] == "model_loading"
        assert early.headers["retry-after"]
        statuses = proc.health_statuses()
        assert statuses[-1] == 200

        client = proc.client(timeout=300)
        results: dict = {}

        def stream(name, max_tokens):
            got = []
            try:
                for c in client.completions.create(model="tiny", prompt="x", max_tokens=max_tokens,
                                                   stream=True, extra_body={"ignore_eos": True}):
                    got.append(c)
                    results[name + "_first"] = True
            except openai.APIError as e:  # the long one: the connection is cut after the drain timeout
                results[name + "_error"] = e
            results[name] = got

        threads = [threading.Thread(target=stream, args=("short", 8)),
                   threading.Thread(target=stream, args=("long", 3000))]
        for t in threads:
            t.start()
        _wait_for(lambda: "short_first" in results and "long_first" in results)
        proc.proc.send_signal(signal.SIGTERM)
        _wait_for(lambda: _refused(proc.port), timeout=30)
        proc.proc.wait(120)
        for t in threads:
            t.join(60)
    finally:
        rc = proc.stop()
    assert rc == 0, proc.output()
    short = results["short"]
    assert "".join(c.choices[0].text for c in short) and short[-1].choices[0].finish_reason == "length"
    assert "short_error" not in results
    assert len(results["long"]) < 3000
    assert "drain timeout" in str(results["long_error"]), "the long request ends with an error event"
    assert "Traceback" not in proc.output()


def test_startup_errors_are_one_line_and_exit_1(tiny_model, tmp_path):
    """A port already taken fails before the model loads; a model that cannot load stops the server."""
    cmd = [*argv(["serve"]), "--device", "cpu"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([*cmd, "--model", str(tiny_model), "--port", str(port)], capture_output=True,
                             text=True, timeout=300)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [f"error: cannot listen on 127.0.0.1:{port}: Address already in use"]

    missing = tmp_path / "missing.nanoqwen"
    out = subprocess.run([*cmd, "--model", str(missing), "--port", "0"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith(f"error: {missing}")
    assert "Traceback" not in out.stderr


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except ConnectionRefusedError:
        return True


def test_load_generator_script(server):
    """scripts/load_openai.py (the GPU load test's driver) runs its levels against a real server."""
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "load_openai.py"), "--base-url", server.base_url,
         "--concurrency", "1,4", "--requests", "4", "--max-tokens", "3", "--prompt-tokens", "8,40",
         "--warmup", "0", "--json"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    assert [lv["concurrency"] for lv in record["levels"]] == [1, 4]
    for lv in record["levels"]:
        assert lv["ok"] == lv["requests"] == 4 and lv["errors"] == {}
        assert lv["mean_completion_tokens"] == 3
        assert lv["output_tok_per_s"] > 0 and lv["ttft_ms_p50"] > 0 and lv["itl_ms_p99"] >= lv["itl_ms_p50"]
    assert record["args"]["model"] == "tiny"


def test_prefill_budgets_shape_the_served_steps(tiny_model, tmp_path, tiny_engine, rng):
    """`serve --prefill-chunk 8 --prefill-chunk-idle 32 --prefill-weights auto --decode-activations fp16` (both
    numerics choices are the GPU's; "auto" and "fp16" are what a CPU server accepts), a real process, the
    openai client: a lone prompt
    of 33..64 tokens is prefilled in 2 engine steps of <= 32 (the idle budget; 5+ in steps of 8), its
    greedy text the engine's; then, with a request decoding beside them, 8 concurrent streams of ~40-token
    prompts (chunks of 8 beside the decoding row) each complete with its exact token count, a client that
    leaves mid-stream is cancelled, and every page ends free."""
    from server_process import ServeProcess

    proc = ServeProcess(tiny_model, tmp_path, "--served-model-name", "tiny", "--prefill-chunk", "8",
                        "--prefill-chunk-idle", "32", "--prefill-weights", "auto", "--decode-activations", "fp16")
    try:
        proc.health_statuses()
        words = ["def", "return", "x", "for", "in", "range", "if", "else", "(", ")", ":", "+", "1"]
        text = " ".join(rng.choice(words, size=40))
        n = len(tiny_engine.encode_prompt(text))
        assert 33 <= n <= 64, n
        before = proc.wait_idle()
        got = proc.client(timeout=300).completions.create(model="tiny", prompt=text, max_tokens=3,
                                                          temperature=0, extra_body={"ignore_eos": True})
        after = proc.wait_idle()
        steps = after["nanoqwen_engine_steps_total"] - before["nanoqwen_engine_steps_total"]
        assert steps == 2 + (3 - 1), steps  # 2 prefill steps (32 + the rest), then 2 decode steps
        want = tiny_engine.complete(text, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert got.choices[0].text == want.text

        leaver = proc.client(timeout=300).completions.create(
            model="tiny", prompt="x", max_tokens=3000, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(leaver)
        next(chunks)  # decoding now: the prompts below get chunks of 8 beside it
        prompts = [" ".join(rng.choice(words, size=int(rng.integers(30, 50)))) for _ in range(8)]

        async def one(client, p):
            stream = await client.completions.create(
                model="tiny", prompt=p, max_tokens=4, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            out = [c async for c in stream]
            return out[-1].usage

        async def go():
            async with proc.async_client(timeout=600) as client:
                return await asyncio.wait_for(asyncio.gather(*(one(client, p) for p in prompts)), timeout=600)

        usages = asyncio.run(go())
        for p, use in zip(prompts, usages, strict=True):
            assert use.completion_tokens == 4 and use.prompt_tokens == len(tiny_engine.encode_prompt(p))
        cancelled = _cancelled(proc.metrics())
        leaver.close()  # the client goes away mid-stream
        _wait_for(lambda: _cancelled(proc.metrics()) == cancelled + 1)
        m = proc.wait_idle()
        assert m["nanoqwen_kv_pages_used"] == 0 and m["nanoqwen_kv_pages_free"] == m["nanoqwen_kv_pages_total"]
    finally:
        rc = proc.stop()
    assert rc == 0, proc.output()
