"""Paged decode attention benchmark (7B dims): time per call and K+V bandwidth vs the H200's copy rate.

    PYTHONPATH=packages/nanoqwen-kernels/src python packages/nanoqwen-kernels/bench/bench_attention.py

Method: R calls (split + combine kernels each) captured in one CUDA graph, each call on the next layer
of a cache whose layers together exceed twice the 60 MB L2, so every call streams its K/V from HBM;
CUDA events around a graph launch, median of many launches, divided by R. Bytes = the K and V the call
must read (seq_len x n_kv x 128 x 2 B x 2). Reference rate: 4.19 TB/s measured copy bandwidth.
A timing is a measurement, never an assertion.
"""

from __future__ import annotations

import sys

import cupy as cp
import numpy as np
from nanoqwen_kernels.attention import AttentionKernels
from nanoqwen_kernels.dims import QWEN25_7B
from nanoqwen_kernels.loader import load_module

COPY_TBS = 4.19
L2_BYTES = 60 * 2**20


def time_graph(fn_per_rep, reps_in_graph: int, launches: int = 30) -> float:
    """Median seconds of one fn call, fn(i) captured reps_in_graph times into one graph."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        fn_per_rep(0)  # compile/load outside the capture
        stream.begin_capture()
        for i in range(reps_in_graph):
            fn_per_rep(i)
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    times = []
    for _ in range(launches):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        graph.launch(stream)
        b.record(stream)
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) * 1e-3 / reps_in_graph)
    return float(np.median(times))


def bench_decode(ctx: int) -> dict:
    d = QWEN25_7B
    ak = AttentionKernels(d, load_module)
    kv_bytes = ctx * d.n_kv_heads * 128 * 2 * 2  # K + V read per call
    n_layers = max(2, -(-2 * L2_BYTES // kv_bytes))
    n_pages = (ctx + 15) // 16
    shape = (n_layers, n_pages, d.n_kv_heads, 16, 128)
    k = cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
    v = cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
    table = cp.asarray(np.random.default_rng(0).permutation(n_pages).astype(np.int32))
    seq = cp.asarray(np.array([ctx], np.int32))
    q = cp.random.standard_normal(d.n_heads * 128, dtype=cp.float32).astype(cp.float16)
    out = cp.empty(d.n_heads * 128, cp.float16)
    ws = ak.new_workspace()
    t = time_graph(lambda i: ak.attention_decode(q, k, v, table, seq, i % n_layers, out, ws), 4 * n_layers)
    gbs = kv_bytes / t / 1e9
    return dict(name=f"attention_decode 7B ctx {ctx}", us=t * 1e6, gbs=gbs, pct=100 * gbs / (COPY_TBS * 1e3))


def main() -> int:
    rows = [bench_decode(ctx) for ctx in (4096, 32768)]
    print("| kernel | time (us) | K+V GB/s | % of 4.19 TB/s |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['name']} | {r['us']:.2f} | {r['gbs']:.0f} | {r['pct']:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
