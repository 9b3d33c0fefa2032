"""The prefill GEMMs per projection shape: the fused INT4 wgmma GEMM (gemm_int4_wg, each tile width and the
one choose_tile picks) against cuBLAS fp16 on the same shape (the peer: the already dequantized weight,
what the engine ran before) and dequantize + cuBLAS.

    PYTHONPATH=packages/nanoqwen-kernels/src python packages/nanoqwen-kernels/bench/bench_prefill_gemm.py
        [7b|1.5b ...] [--m 512,2048,4096] [--widths] [--only qkv,o,gate_up,down] [--sweep]
    --sweep: every (width, splits) plan per shape instead (us), and which one choose_plan picks
    --fp8: the FP8 GEMM (gemm_fp8 on the e4m3 copy of the weight, X quantized by quantize_e4m3, timed apart)
        in place of the fused INT4 one, against the same cuBLAS fp16 peer; with --sweep, its plans

Times: our kernel in a CUDA graph of n back-to-back launches (time_graph: the GPU's time, no Python);
cuBLAS with CUDA events around n eager calls (CuPy refuses cuBLAS under capture; at these sizes the ~5 us
of Python per call hides behind the GPU's queue). TFLOP/s = 2 M N K / time. A measurement, never an
assertion. The last lines are a table: per shape, the fused GEMM's TFLOP/s against cuBLAS's.
"""

from __future__ import annotations

import sys

import cupy as cp
import numpy as np
from bench_attention import time_graph
from bench_prefill import time_calls
from nanoqwen_kernels import prefill_gemm as pg
from nanoqwen_kernels.dims import PRESETS
from nanoqwen_kernels.loader import load_module
from nanoqwen_kernels.prefill import PrefillKernels


def shapes(d):
    return [("qkv", d.qkv_rows, d.hidden), ("o", d.hidden, d.hidden), ("gate_up", 2 * d.intermediate, d.hidden),
            ("down", d.hidden, d.intermediate)]


def bench_shape(pk, name, proj, n, k, m, qw, sc, w, widths: bool) -> tuple:
    """One (shape, M): prints the line, returns the table row."""
    x = cp.random.standard_normal((m, k), dtype=cp.float32).astype(cp.float16)
    out = cp.empty((m, n), cp.float16)
    fl = 2.0 * m * n * k
    reps = max(2, min(20, int(2e12 / fl)))
    bn, sp = pg.choose_plan(m, n, k, 132)
    ws = cp.empty(max(1, sp * m * n), cp.float32)  # allocated before the capture
    t_wg = time_graph(lambda i: pk.gemm_int4_wg(qw, sc, x, out, workspace=ws), reps, launches=5)
    per_w = {}
    if widths:
        for b in pg.GW_WIDTHS:
            per_w[b] = time_graph(lambda i, b=b: pk.gemm_int4_wg(qw, sc, x, out, tile=b, splits=1), reps, launches=5)
    t_cb = time_calls(lambda: pk.gemm_f16(w, x, out), n=reps, batches=5)
    t_dq = time_calls(lambda: pk.dequantize_int4(qw, sc, w), n=reps, batches=5)
    extra = "; ".join(f"n{b}: {t * 1e6:.1f} us {fl / t / 1e12:.0f}" for b, t in per_w.items())
    print(f"{name} {proj} {n}x{k} M={m}: wg[{bn}x{sp}] {t_wg * 1e6:.1f} us {fl / t_wg / 1e12:.0f} TFLOP/s | "
          f"cuBLAS fp16 {t_cb * 1e6:.1f} us {fl / t_cb / 1e12:.0f} | dequant+cuBLAS "
          f"{(t_cb + t_dq) * 1e6:.1f} us {fl / (t_cb + t_dq) / 1e12:.0f} | {extra}", flush=True)
    plan = f"n{bn}" + (f" / {sp} splits" if sp > 1 else "")
    return (name, proj, n, k, m, plan, t_wg, fl / t_wg / 1e12, t_cb, fl / t_cb / 1e12)


def fp8_operands(f8, n, k, m, qw, sc):
    """Random X [m, k] quantized, the weight's e4m3 copy, an output: (x, out, w8, sw, xq, sx)."""
    x = cp.random.standard_normal((m, k), dtype=cp.float32).astype(cp.float16)
    w8, sw = f8.int4_to_e4m3(qw, sc)
    xq, sx = cp.empty((m, k), cp.uint8), cp.empty(m, cp.float32)
    f8.quantize_e4m3(x, xq, sx)
    return x, cp.empty((m, n), cp.float16), w8, sw, xq, sx


def bench_fp8_shape(pk, name, proj, n, k, m, qw, sc, w) -> tuple:
    """One (shape, M) of the FP8 GEMM: prints the line, returns the table row (as bench_shape's)."""
    f8 = pk.fp8
    x, out, w8, sw, xq, sx = fp8_operands(f8, n, k, m, qw, sc)
    fl = 2.0 * m * n * k
    reps = max(2, min(40, int(4e12 / fl)))
    bn, sp = pg.choose_plan_fp8(m, n, k, 132)
    ws = cp.empty(max(1, sp * m * n), cp.float32)
    t_f8 = time_graph(lambda i: f8.gemm_fp8(w8, sw, xq, sx, out, workspace=ws), reps, launches=5)
    t_q = time_graph(lambda i: f8.quantize_e4m3(x, xq, sx), reps, launches=5)
    t_cb = time_calls(lambda: pk.gemm_f16(w, x, out), n=reps, batches=5)
    print(f"{name} {proj} {n}x{k} M={m}: fp8[{bn}x{sp}] {t_f8 * 1e6:.1f} us {fl / t_f8 / 1e12:.0f} TFLOP/s "
          f"(+ quantize X {t_q * 1e6:.1f} us) | cuBLAS fp16 {t_cb * 1e6:.1f} us {fl / t_cb / 1e12:.0f}", flush=True)
    plan = f"n{bn}" + (f" / {sp} splits" if sp > 1 else "")
    return (name, proj, n, k, m, plan, t_f8, fl / t_f8 / 1e12, t_cb, fl / t_cb / 1e12)


def sweep(pk, name, proj, n, k, m, qw, sc, fp8: bool = False) -> None:
    """Every (width, splits) plan of one shape, us each, the plan choose_plan (choose_plan_fp8) picks marked."""
    if fp8:
        x, out, w8, sw, xq, sx = fp8_operands(pk.fp8, n, k, m, qw, sc)
        widths, pick = pg.GF8_WIDTHS, pg.choose_plan_fp8(m, n, k, 132)

        def gemm(bn, s, ws):
            pk.fp8.gemm_fp8(w8, sw, xq, sx, out, tile=bn, splits=s, workspace=ws)
    else:
        x = cp.random.standard_normal((m, k), dtype=cp.float32).astype(cp.float16)
        out = cp.empty((m, n), cp.float16)
        widths, pick = pg.GW_WIDTHS, pg.choose_plan(m, n, k, 132)

        def gemm(bn, s, ws):
            pk.gemm_int4_wg(qw, sc, x, out, tile=bn, splits=s, workspace=ws)
    ws = cp.empty(max(pg.GW_SPLITS) * m * n, cp.float32)
    fl = 2.0 * m * n * k
    cells = []
    for bn in widths:
        for s in pg.GW_SPLITS:
            if s > 1 and k // 128 < 2 * s:
                continue
            t = time_graph(lambda i, bn=bn, s=s: gemm(bn, s, ws), 10, launches=5)
            mark = "*" if (bn, s) == pick else ""
            cells.append(f"{mark}n{bn}x{s} {t * 1e6:.1f} ({fl / t / 1e12:.0f})")
    print(f"sweep{'-fp8' if fp8 else ''} {name} {proj} M={m}: " + " | ".join(cells), flush=True)


def main() -> int:
    presets = [a for a in sys.argv[1:] if a in PRESETS] or ["7b"]
    ms = [int(v) for v in sys.argv[sys.argv.index("--m") + 1].split(",")] if "--m" in sys.argv else [512, 2048]
    widths = "--widths" in sys.argv
    use_fp8 = "--fp8" in sys.argv
    only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else None
    rng = np.random.default_rng(0)
    rows = []
    for name in presets:
        d = PRESETS[name]
        pk = PrefillKernels(d, load_module)
        for proj, n, k in shapes(d):
            if only and proj not in only:
                continue
            qw = cp.asarray(rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32))
            sc = cp.asarray(rng.uniform(1e-3, 5e-2, size=(n, k // 128)).astype(np.float16))
            w = cp.empty((n, k), cp.float16)
            pk.dequantize_int4(qw, sc, w)
            for m in ms:
                if "--sweep" in sys.argv:
                    sweep(pk, name, proj, n, k, m, qw, sc, fp8=use_fp8)
                    continue
                rows.append((bench_fp8_shape if use_fp8 else bench_shape)(pk, name, proj, n, k, m, qw, sc, w,
                                                                         *(() if use_fp8 else (widths,))))
    label = "FP8 (us, TFLOP/s)" if use_fp8 else "fused INT4 wg (us, TFLOP/s)"
    print(f"\n| model | GEMM | N x K | M | {label} | cuBLAS fp16 (us, TFLOP/s) | ours / cuBLAS |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, proj, n, k, m, bn, t_wg, f_wg, t_cb, f_cb in rows:
        print(f"| {name} | {proj} | {n} x {k} | {m} | {t_wg * 1e6:.1f}, **{f_wg:.0f}** ({bn}) | "
              f"{t_cb * 1e6:.1f}, {f_cb:.0f} | {t_cb / t_wg:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
