"""The engine's serving API on the CPU reference backend: submit, RequestHandle (threads and asyncio),
cancel, result, stats, close, and many callers at once. Prompts are token ids of the tied model (vocab
4096, fast lm_head) unless a test needs the tokenizer's text path."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from engine_testutil import pool_idle
from nanoqwen_engine import (
    Engine,
    EngineClosedError,
    InvalidRequestError,
    NanoqwenError,
    QueueFullError,
    SamplingParams,
)

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def tied_engine(tied_path):
    engine = Engine.load(tied_path, device="cpu", max_context=256, kv_pages=64, progress=False)
    yield engine
    engine.close()


def prompts(rng, n, lo=3, hi=40):
    return [rng.integers(0, 4096, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def test_submit_iterate_and_result_agree_with_complete(tied_engine, rng):
    p = prompts(rng, 1)[0]
    want = tied_engine.complete(p, GREEDY)
    h = tied_engine.submit(p, GREEDY)
    assert h.prompt_tokens == len(p) and isinstance(h.request_id, int)
    events = list(h)
    assert [e.token_id for e in events] == want.token_ids and events[-1].finish_reason == "length"
    assert all(e.finish_reason is None for e in events[:-1])
    assert list(h) == []  # consumed once
    r = h.result()
    assert r.token_ids == want.token_ids and r.text == want.text and r.prompt_tokens == len(p)
    assert {"queue_s", "prefill_s", "decode_s", "ttft_s", "preemptions", "seed"} <= set(r.stats)
    assert pool_idle(tied_engine.backend.pool)


def test_async_for_streams_without_blocking_the_loop(tied_engine, rng):
    ps = prompts(rng, 3)
    want = [tied_engine.complete(p, GREEDY).token_ids for p in ps]

    async def main():
        ticks = 0
        stop = asyncio.Event()

        async def ticker():  # runs only if the loop is never blocked by a waiting consumer
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        async def consume(h):
            return [ev.token_id async for ev in h]

        t = asyncio.create_task(ticker())
        handles = [tied_engine.submit(p, GREEDY) for p in ps]
        got = await asyncio.gather(*(consume(h) for h in handles))
        stop.set()
        await t
        return got, ticks

    got, ticks = asyncio.run(main())
    assert got == want
    assert ticks > 10
    assert pool_idle(tied_engine.backend.pool)


def test_cancel_mid_stream_frees_pages_and_ends_with_cancelled(tied_engine, rng):
    p = prompts(rng, 1)[0]
    h = tied_engine.submit(p, SamplingParams(temperature=0, max_tokens=200))
    it = iter(h)
    first = [next(it).token_id, next(it).token_id]
    h.cancel()
    rest = list(it)
    assert rest[-1].finish_reason == "cancelled" and rest[-1].token_id == -1
    r = h.result()
    assert r.finish_reason == "cancelled" and r.token_ids[:2] == first and len(r.token_ids) < 200
    assert pool_idle(tied_engine.backend.pool)
    h.cancel()  # idempotent once ended
    assert tied_engine.stats()["requests_cancelled"] == 1


def test_cancel_while_waiting_and_queue_full(tied_path, rng):
    """max_batch=1: a long request runs, the next waits; with max_queue=1 a third is refused."""
    engine = Engine.load(tied_path, device="cpu", max_context=1024, kv_pages=128, progress=False,
                         max_batch=1, max_queue=1)
    long = engine.submit(prompts(rng, 1)[0], SamplingParams(temperature=0, max_tokens=900))
    next(iter(long))  # running now
    waiting = engine.submit(prompts(rng, 1)[0], GREEDY)
    with pytest.raises(QueueFullError, match="max_queue 1"):
        engine.submit(prompts(rng, 1)[0], GREEDY)
    assert engine.stats()["waiting"] == 1 and engine.stats()["running"] == 1
    waiting.cancel()
    r = waiting.result()
    assert r.finish_reason == "cancelled" and r.token_ids == []
    long.cancel()
    assert long.result().finish_reason == "cancelled"
    assert pool_idle(engine.backend.pool)
    engine.close()


def test_close_ends_pending_requests_and_refuses_new_ones(tied_path, rng):
    engine = Engine.load(tied_path, device="cpu", max_context=1024, kv_pages=128, progress=False, max_batch=1)
    a = engine.submit(prompts(rng, 1)[0], SamplingParams(temperature=0, max_tokens=900))
    b = engine.submit(prompts(rng, 1)[0], GREEDY)
    next(iter(a))
    engine.close()
    for h in (a, b):
        with pytest.raises(EngineClosedError):
            h.result()
    with pytest.raises(EngineClosedError):
        engine.submit(prompts(rng, 1)[0], GREEDY)
    with pytest.raises(EngineClosedError):
        engine.score([1, 2, 3])
    assert pool_idle(engine.backend.pool) and engine.stats()["closed"]
    engine.close()  # idempotent


def test_stats_counts(tied_engine, rng):
    s0 = tied_engine.stats()
    assert {"waiting", "running", "kv_pages_used", "kv_pages_free", "kv_pages_total", "steps",
            "requests_finished", "preemptions", "tokens_generated"} <= set(s0)
    tied_engine.complete(prompts(rng, 1)[0], GREEDY)
    s = tied_engine.stats()
    assert s["requests_finished"] == s0["requests_finished"] + 1
    assert s["tokens_generated"] == s0["tokens_generated"] + 12
    assert s["kv_pages_used"] == 0 and s["kv_pages_free"] == s["kv_pages_total"] == 64


def test_an_error_inside_a_step_reaches_every_row_and_the_engine_goes_on(tied_engine, rng, monkeypatch):
    ps = prompts(rng, 3)
    want = tied_engine.complete(ps[0], GREEDY).token_ids
    real = tied_engine.backend.decode
    boom = NanoqwenError("device fell over")
    calls = {"n": 0}

    def flaky(seqs, ids, samplers, run_ahead=False):
        calls["n"] += 1
        if calls["n"] == 3:
            raise boom
        return real(seqs, ids, samplers, run_ahead=run_ahead)

    monkeypatch.setattr(tied_engine.backend, "decode", flaky)
    hs = [tied_engine.submit(p, SamplingParams(temperature=0, max_tokens=30)) for p in ps]
    failed = 0
    for h in hs:
        try:
            h.result()
        except NanoqwenError as e:
            assert e is boom
            failed += 1
    assert failed >= 1
    assert pool_idle(tied_engine.backend.pool)
    assert tied_engine.complete(ps[0], GREEDY).token_ids == want


def test_many_threads_complete_at_once_each_gets_its_solo_tokens(tiny_path):
    """The issue's finding: 4 threads calling complete() on one Engine got wrong tokens and leaked pages.
    Through the engine thread, 6 at once each get exactly the greedy tokens they get alone."""
    engine = Engine.load(tiny_path, device="cpu", max_context=96, kv_pages=48, progress=False)
    texts = ["def fib(n):", "import numpy as np\n", "class Stack:", "SELECT * FROM", "fn main() {",
             "#include <stdio.h>\n"]
    params = SamplingParams(temperature=0, max_tokens=10)
    solo = [engine.complete(t, params).token_ids for t in texts]
    got: list = [None] * len(texts)
    barrier = threading.Barrier(len(texts))

    def worker(i):
        barrier.wait()
        got[i] = engine.complete(texts[i], params).token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == solo
    assert pool_idle(engine.backend.pool)
    assert engine.stats()["decode_rows"] > engine.stats()["steps"]  # rows really shared steps
    engine.close()


def test_prompt_as_token_ids_is_checked(tied_engine):
    assert tied_engine.encode_prompt([1, 2, 3]) == [1, 2, 3]
    assert tied_engine.encode_prompt(np.array([4, 5], dtype=np.int32)) == [4, 5]
    for bad, match in (([1, 4096], "0..4095"), ([1, -1], "0..4095"), ([1, 2.5], "integers"),
                       (np.zeros((2, 2), dtype=np.int64), "1-D"), (np.array([1.0]), "integer token ids"),
                       (42, "str, a list of token ids")):
        with pytest.raises(InvalidRequestError, match=match):
            tied_engine.submit(bad, GREEDY)
    assert pool_idle(tied_engine.backend.pool)


@pytest.mark.parametrize("bad, match", [
    ([2**63], "0..4095"), (["a"], "integers"), ([float("nan")], "integers"), ([[1, 2], [3]], "integers"),
    (None, "1-D sequence"), ([1.7, 2.2], "integers"), (np.array([[1, 2], [3, 4]]), "1-D"),
    (np.array([1.0, 2.0]), "integer token ids"), ([], "at least one"), ([True, 1], "integers"),
])
def test_score_refuses_anything_but_1d_integer_ids(tied_engine, bad, match):
    with pytest.raises(InvalidRequestError, match=match):
        tied_engine.score(bad)


def test_score_accepts_numpy_and_python_ints(tied_engine):
    a = tied_engine.score([1, 2, np.int64(3)])
    b = tied_engine.score(np.array([1, 2, 3], dtype=np.int32))
    np.testing.assert_array_equal(a, b)
    assert a.shape == (3, 4096)
