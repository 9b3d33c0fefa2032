"""`bench --concurrency 1,8,32,64`: N requests submitted at once through the engine's batched API
(Engine.submit), measured as their callers see them.

All N requests of a level are submitted back to back (the prompt tokenized once, submitted as token
ids) and consumed on one asyncio loop (`async for` over each RequestHandle), which timestamps every
event as it arrives. From those timestamps:

- aggregate throughput: every generated token of the level / (last event - first submit), prompts'
  prefill included;
- decode throughput: the tokens that arrive after every request has its first token / the time from that
  moment to the last event: the steady decode of the whole batch, which is what issue 13's "aggregate
  decode throughput" targets and what scripts/bench_batch.py measures at the backend level;
- time to first token (TTFT): first event - that request's submit;
- inter-token latency (ITL): the gaps between consecutive events of one request, over all requests;

p50 and p99 of TTFT and ITL over every request (every gap) of every timed run. One event loop on one
thread, rather than N consumer threads, keeps the measuring side from competing for the GIL with the
engine thread that it measures.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from nanoqwen_cli.bench_report import spread


def _one_run(engine, ids: list[int], params, n: int) -> dict:
    from nanoqwen_engine.request import NO_TOKEN

    async def consume(handle) -> list[float]:
        times = []
        async for event in handle:
            if event.token_id != NO_TOKEN:
                times.append(time.perf_counter())
        return times

    async def level() -> tuple[list[float], list[list[float]], float, list]:
        submitted, handles = [], []
        for _ in range(n):
            submitted.append(time.perf_counter())
            handles.append(engine.submit(ids, params))
        times = await asyncio.gather(*(consume(h) for h in handles))
        return submitted, times, time.perf_counter(), handles

    submitted, times, t_end, handles = asyncio.run(level())
    tokens = sum(len(t) for t in times)
    all_first = max((t[0] for t in times if t), default=t_end)
    last = max((t[-1] for t in times if t), default=t_end)
    return {
        "tokens": tokens,
        "wall_s": t_end - submitted[0],
        "decode_tokens": sum(1 for t in times for x in t if x > all_first),
        "decode_s": last - all_first,
        "ttft_s": [t[0] - s for s, t in zip(submitted, times, strict=True) if t],
        "itl_s": [float(g) for t in times for g in np.diff(t)],
        "preemptions": sum(h.result().stats.get("preemptions", 0) for h in handles),
    }


def measure_level(engine, ids: list[int], params, n: int, runs: int, warmup: int) -> dict:
    """One concurrency level: `warmup` untimed runs, then `runs` timed ones of n requests each."""
    for _ in range(warmup):
        _one_run(engine, ids, params, n)
    timed = [_one_run(engine, ids, params, n) for _ in range(runs)]
    rates = [r["tokens"] / r["wall_s"] for r in timed]
    decode_rates = [r["decode_tokens"] / r["decode_s"] for r in timed if r["decode_tokens"] and r["decode_s"] > 0]
    ttft = np.array([x for r in timed for x in r["ttft_s"]]) * 1e3
    itl = np.array([x for r in timed for x in r["itl_s"]] or [float("nan")]) * 1e3
    s = spread(rates)
    return {
        "concurrency": n,
        "runs": runs,
        "generated_tokens": [r["tokens"] for r in timed],
        "wall_s": [r["wall_s"] for r in timed],
        "aggregate_tok_s": s["median"],
        "aggregate_tok_s_spread": s,
        "decode_tok_s": spread(decode_rates)["median"] if decode_rates else None,
        "ttft_ms_p50": float(np.percentile(ttft, 50)),
        "ttft_ms_p99": float(np.percentile(ttft, 99)),
        "itl_ms_p50": float(np.percentile(itl, 50)),
        "itl_ms_p99": float(np.percentile(itl, 99)),
        "preemptions": sum(r["preemptions"] for r in timed),
    }
