"""Paged decode attention benchmark (7B dims, batch 1 and batched): time per call and K+V bandwidth vs the
H200's copy rate.

    PYTHONPATH=packages/nanoqwen-kernels/src python packages/nanoqwen-kernels/bench/bench_attention.py \
        [--variants fma,mma]    # default: every consumer variant

Method: R calls captured in one CUDA graph, each call on the next layer
of a cache whose layers together exceed twice the 60 MB L2, so every call streams its K/V from HBM;
CUDA events around a graph launch, median of many launches, divided by R. Bytes = the K and V the call
must read (seq_len x n_kv x 128 x 2 B x 2). Reference rate: 4.19 TB/s measured copy bandwidth.
A timing is a measurement, never an assertion.
"""

from __future__ import annotations

import subprocess
import sys

import cupy as cp
import numpy as np
from nanoqwen_kernels.attention import VARIANTS, AttentionKernels
from nanoqwen_kernels.dims import QWEN25_7B
from nanoqwen_kernels.loader import load_module

COPY_TBS = 4.19
L2_BYTES = 60 * 2**20


def time_graph(fn_per_rep, reps_in_graph: int, launches: int = 30) -> float:
    """Median seconds of one fn call, fn(i) captured reps_in_graph times into one graph."""
    # The inputs were made on the legacy default stream and this stream does not wait for it: without the
    # synchronize, the first calls could read a page table whose copy had not landed yet (pool memory
    # recycled from the float32 temporaries: garbage page ids, an illegal address). That was the
    # "unexplained" fault of this benchmark's decode rows, found 2026-12-01.
    cp.cuda.Device().synchronize()
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


def bench_decode(ctx: int, variant: str, batch: int = 1, dims=QWEN25_7B, label: str = "7B") -> dict:
    """`batch` sequences of `ctx` tokens each, pages scattered through one pool."""
    d = dims
    ak = AttentionKernels(d, load_module, variant)
    kv_bytes = batch * ctx * d.n_kv_heads * 128 * 2 * 2  # K + V read per call
    n_layers = max(2, -(-2 * L2_BYTES // kv_bytes))
    per_seq = (ctx + 15) // 16
    n_pages = batch * per_seq
    shape = (n_layers, n_pages, d.n_kv_heads, 16, 128)
    k = cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
    v = cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
    perm = np.random.default_rng(0).permutation(n_pages).astype(np.int32)
    table = cp.asarray(perm.reshape(batch, per_seq))
    seq = cp.asarray(np.full(batch, ctx, np.int32))
    q = cp.random.standard_normal((batch, d.n_heads * 128), dtype=cp.float32).astype(cp.float16)
    out = cp.empty((batch, d.n_heads * 128), cp.float16)
    ws = ak.new_workspace(max_batch=batch)
    t = time_graph(lambda i: ak.attention_decode(q, k, v, table, seq, i % n_layers, out, ws), 4 * n_layers)
    gbs = kv_bytes / t / 1e9
    return dict(
        name=f"attention_decode[{variant}] {label} B={batch} ctx {ctx}",
        us=t * 1e6,
        gbs=gbs,
        pct=100 * gbs / (COPY_TBS * 1e3),
    )


def smoke() -> int:
    """Every attention and prefill kernel (every variant) once on small shapes, pool allocator off so each array is its
    own cudaMalloc (compute-sanitizer memcheck then sees any out-of-bounds access)."""
    from nanoqwen_kernels.dims import TINY
    from nanoqwen_kernels.prefill import ATTENTION_VARIANTS, PrefillKernels

    cp.cuda.set_allocator(None)
    rng = np.random.default_rng(0)
    for d, ctx in ((TINY, 40), (QWEN25_7B, 100)):
        n_pages = (ctx + 15) // 16 + 2
        shape = (2, n_pages, d.n_kv_heads, 16, 128)
        kc = cp.asarray(rng.standard_normal(shape).astype(np.float16))
        vc = cp.asarray(rng.standard_normal(shape).astype(np.float16))
        table = cp.asarray(rng.permutation(n_pages).astype(np.int32))
        T, start = 23, ctx - 23
        qkv = cp.asarray(rng.standard_normal((T, d.qkv_rows)).astype(np.float16))
        q = cp.empty((T, d.q_dim), cp.float16)
        pk = PrefillKernels(d, load_module)
        pk.rope_kv_prefill(qkv, start, table, kc, vc, 1, q)
        qw = cp.asarray(rng.integers(0, 2**32, size=(256, 32), dtype=np.uint32))
        sc = cp.asarray(rng.uniform(0.01, 0.02, size=(256, 2)).astype(np.float16))
        y = cp.empty((T, 256), cp.float16)
        pk.gemm_int4(qw, sc, cp.asarray(rng.standard_normal((T, 256)).astype(np.float16)), y)
        seq = cp.asarray(np.array([ctx], np.int32))
        for pv in ATTENTION_VARIANTS:
            out = cp.empty((T, d.q_dim), cp.float16)
            PrefillKernels(d, load_module, pv).attention_prefill(q, kc, vc, table, start, T, 1, out)
            for dv in VARIANTS:
                ak = AttentionKernels(d, load_module, dv)
                o1 = cp.empty(d.q_dim, cp.float16)
                ak.attention_decode(q[-1].copy(), kc, vc, table, seq, 1, o1, ak.new_workspace(max_batch=1))
                cp.cuda.Device().synchronize()
                # the last prefill row and a decode step at the same position see the same keys
                diff = float(cp.abs(out[-1].astype(cp.float32) - o1.astype(cp.float32)).max())
                print(
                    f"smoke n_heads={d.n_heads} prefill[{pv}] vs decode[{dv}] last row: max diff {diff:.2e}"
                )
        print(f"smoke n_heads={d.n_heads} gemm sum {float(y.astype(cp.float32).sum()):.3f}")
    return 0


def main() -> int:
    if "--smoke" in sys.argv:
        return smoke()
    if "--variant" in sys.argv:  # one variant in this process (main() runs each in its own)
        v = sys.argv[sys.argv.index("--variant") + 1]
        # batch 1 at a long context (issue 15's case), and the batched protocol's contexts (128 prompt +
        # up to 256 generated tokens) at the batch sizes the engine runs
        from nanoqwen_kernels.dims import QWEN25_1_5B

        for batch, ctx in ((1, 640), (1, 1024), (1, 4096), (1, 16384), (1, 32768), (8, 384), (32, 384), (64, 384)):
            r = bench_decode(ctx, v, batch)
            print(f"| {r['name']} | {r['us']:.2f} | {r['gbs']:.0f} | {r['pct']:.1f}% |", flush=True)
        for batch, ctx in ((1, 640), (1, 4096), (1, 32768), (32, 384)):
            r = bench_decode(ctx, v, batch, QWEN25_1_5B, "1.5B dims")
            print(f"| {r['name']} | {r['us']:.2f} | {r['gbs']:.0f} | {r['pct']:.1f}% |", flush=True)
        return 0
    # Each variant in its own process: a sticky CUDA error (an illegal address) takes the whole context,
    # and every later row, with it; in a process of its own it costs only its variant's rows.
    print("| kernel | time (us) | K+V GB/s | % of 4.19 TB/s |")
    print("| --- | --- | --- | --- |", flush=True)
    worst = 0
    for v in sys.argv[sys.argv.index("--variants") + 1].split(",") if "--variants" in sys.argv else VARIANTS:
        p = subprocess.run([sys.executable, __file__, "--variant", v], capture_output=True, text=True)
        rows = [ln for ln in p.stdout.splitlines() if ln.startswith("|")]
        print("\n".join(rows), flush=True)
        if p.returncode:
            print(p.stderr[-3000:], file=sys.stderr)  # the whole traceback, for the log
            tail = (p.stderr.strip().splitlines() or ["?"])[-1]
            print(
                f"| attention_decode[{v}] | FAILED (rc {p.returncode}) after {len(rows)} rows: {tail} | | |"
            )
            worst = 1
    return worst


if __name__ == "__main__":
    sys.exit(main())
