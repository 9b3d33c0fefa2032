"""Prefill benchmarks (7B dims): INT4 GEMM at M = 512 (dequantize + cuBLAS), RoPE/KV write, causal attention.

    PYTHONPATH=packages/nanoqwen-kernels/src python packages/nanoqwen-kernels/bench/bench_prefill.py [7b|1.5b]
        [--attention-only]     # the dims preset (default 7b); only RoPE/KV and attention (no GEMMs)

CUDA events around N back-to-back calls on one stream, median of several such batches, divided by N.
GEMM: TFLOP/s "effective" = 2 M N K / (dequantize + GEMM time); beside it cuBLAS alone on the already
dequantized fp16 weight (the peer, and the ceiling of this two-step design) and the dequantizer alone.
Attention: FLOPs counted as 4 x heads x 128 x (causal pairs), i.e. QK^T and PV, no masked work.
RoPE/KV and attention also print "graph": the same calls captured in a CUDA graph (time_graph), the
kernels' own time without Python's per-launch overhead, which the eager loop includes.
A timing is a measurement, never an assertion.
"""

from __future__ import annotations

import sys

import cupy as cp
import numpy as np
from bench_attention import time_graph  # this folder's graph timer (n calls in one graph, median)
from nanoqwen_kernels.dims import PRESETS
from nanoqwen_kernels.loader import load_module
from nanoqwen_kernels.prefill import ATTENTION_VARIANTS, PrefillKernels

D = PRESETS[next((a for a in sys.argv[1:] if a in PRESETS), "7b")]
M = 512
# (name, N, K) of the 7B projections as the prefill runs them (q/k/v fused, gate/up fused)
PROJ = [
    ("qkv", D.qkv_rows, D.hidden),
    ("o", D.hidden, D.hidden),
    ("gate_up", 2 * D.intermediate, D.hidden),
    ("down", D.hidden, D.intermediate),
]


def time_calls(fn, n: int = 10, batches: int = 7) -> float:
    stream = cp.cuda.get_current_stream()
    fn()
    stream.synchronize()
    times = []
    for _ in range(batches):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        for _ in range(n):
            fn()
        b.record(stream)
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) * 1e-3 / n)
    return float(np.median(times))


def bench_gemm(pk: PrefillKernels, name: str, n: int, k: int, rng) -> float:
    qw = cp.asarray(rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32))
    sc = cp.asarray(rng.uniform(1e-3, 5e-2, size=(n, k // 128)).astype(np.float16))
    x = cp.random.standard_normal((M, k), dtype=cp.float32).astype(cp.float16)
    out = cp.empty((M, n), cp.float16)
    ws = cp.empty(n * k, cp.float16)
    w = ws.reshape(n, k)
    t = time_calls(lambda: pk.gemm_int4(qw, sc, x, out, workspace=ws))
    t_mm = time_calls(lambda: cp.matmul(x, w.T, out=out))
    t_dq = time_calls(lambda: pk.dequantize_int4(qw, sc, w))
    # GPU time of the two kernels (what an engine that enqueues ahead of the GPU sees); the eager
    # loop above also pays Python's launch overhead, which dominates for the small projections.
    # (A CUDA graph would measure it directly, but CuPy refuses cuBLAS calls under stream capture.)
    t_k = t_mm + t_dq
    fl = 2.0 * M * n * k
    print(
        f"| gemm_int4 {name} {n}x{k} | {t * 1e6:.1f} | {fl / t / 1e12:.0f} | {t_k * 1e6:.1f}, "
        f"{fl / t_k / 1e12:.0f} | {t_mm * 1e6:.1f}, {fl / t_mm / 1e12:.0f} | {t_dq * 1e6:.1f} |"
    )
    return t_k


def bench_attention(pk: PrefillKernels, kc, vc, table, T: int, n: int, batches: int) -> None:
    """pk's attention variant at T queries from position 0."""
    qt = cp.random.standard_normal((T, D.q_dim), dtype=cp.float32).astype(cp.float16)
    out = cp.empty((T, D.q_dim), cp.float16)
    t = time_calls(lambda: pk.attention_prefill(qt, kc, vc, table, 0, T, 0, out), n=n, batches=batches)
    fl = 4.0 * D.n_heads * 128 * T * (T + 1) / 2
    g = time_graph(lambda i: pk.attention_prefill(qt, kc, vc, table, 0, T, 0, out), n, launches=batches + 2)
    print(
        f"| attention_prefill[{pk.attention_variant}] T = {T} | {t * 1e6:.1f} | {fl / t / 1e12:.1f} | "
        f"graph: {g * 1e6:.1f} us, {fl / g / 1e12:.1f} TFLOP/s | | |"
    )


def main() -> int:
    pk = PrefillKernels(D, load_module)
    rng = np.random.default_rng(0)
    print(
        f"| prefill kernel ({D.n_heads} heads, hidden {D.hidden}, M = 512) | eager (us) | TFLOP/s | kernels: dequant + cuBLAS (us, TFLOP/s) "
        "| cuBLAS fp16 alone (us, TFLOP/s) | dequant (us) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    gemms = "--attention-only" not in sys.argv
    total = sum(bench_gemm(pk, name, n, k, rng) for name, n, k in PROJ) * D.n_layers if gemms else 0.0

    n_pages = 32768 // 16 + 1
    cache_shape = (1, n_pages, D.n_kv_heads, 16, 128)
    kc = cp.random.standard_normal(cache_shape, dtype=cp.float32).astype(cp.float16)
    vc = cp.random.standard_normal(cache_shape, dtype=cp.float32).astype(cp.float16)
    table = cp.asarray(rng.permutation(n_pages).astype(np.int32))
    qkv = cp.random.standard_normal((M, D.qkv_rows), dtype=cp.float32).astype(cp.float16)
    q = cp.empty((M, D.q_dim), cp.float16)
    bias = cp.random.standard_normal(D.qkv_rows, dtype=cp.float32).astype(cp.float16)
    for body in ("scalar", "vec"):
        pk.rope_body = body
        t = time_calls(lambda: pk.rope_kv_prefill(qkv, 0, table, kc, vc, 0, q, bias=bias))
        g = time_graph(lambda i: pk.rope_kv_prefill(qkv, 0, table, kc, vc, 0, q, bias=bias), 20, launches=15)
        print(f"| rope_kv_prefill[{body}] T = {M} | {t * 1e6:.1f} | | graph: {g * 1e6:.1f} us | | |")
    wanted = sys.argv[sys.argv.index("--variants") + 1].split(",") if "--variants" in sys.argv else ATTENTION_VARIANTS
    for variant in wanted:
        pa = PrefillKernels(D, load_module, variant)
        for T, n, b in ((512, 10, 7), (2048, 5, 5), (8192, 2, 3), (32768, 1, 1)):
            bench_attention(pa, kc, vc, table, T, n, b)
    if gemms:
        print(f"\n{D.n_layers} layers of the four GEMMs at M = {M} (kernel time): {total * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
