"""GEMV microbenchmark: the decode GEMVs at a model's shapes for B sequences at once, against the copy
bandwidth, with cuBLAS (cupy.matmul, fp16 out) as the lm_head's peer.

    PYTHONPATH=packages/nanoqwen-kernels/src python packages/nanoqwen-kernels/bench/bench_gemv.py \\
        --batch 1,8,32,64 [--dims 7b] [--variant default,tiles] [--sweep] [--json out.json]

Method: each kernel is launched PER_GRAPH times inside one captured CUDA graph, cycling through enough
copies of its weights that the bytes between two reads of the same copy exceed the L2 (so every launch
streams from HBM, as in a decode step); the graph is timed with CUDA events `reps` times and the median /
PER_GRAPH is the per-launch time. In-graph timing is how the kernels run in the engine (one graph per
step), and it excludes the ~5 us of an eager Python launch. GB/s = weight bytes (INT4 words + scales, or
fp16 rows) / time: what a GEMV must stream once per step whatever B is; % is of the H200's measured copy
bandwidth. "step" sums one decode step's GEMVs (layers x (qkv + o + gate/up + down) + lm_head).
A timing is printed, never asserted.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys

import numpy as np

COPY_BW = 4.19e12  # B/s: device-to-device copy measured on the H200 here (docs/PERF.md)
ROTATE_BYTES = 256 << 20  # weights cycled per graph: > 4x the 50-60 MB L2
PER_GRAPH = 20


def _time_graph(cp, launches, reps: int) -> tuple[float, str]:
    """Median seconds per launch of `launches` (callables) replayed in one graph, and how it was timed:
    "graph", or "eager" when the launches could not be captured (Python's launch cost is then in it)."""
    cp.cuda.Device().synchronize()  # inputs made on the legacy stream, which this one does not wait for
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for f in launches[:2]:  # warm up (module load, cuBLAS handle) outside the capture
            f()
        stream.synchronize()
        try:
            stream.begin_capture()
            for f in launches:
                f()
            graph = stream.end_capture()
            run = lambda: graph.launch(stream)  # noqa: E731
            mode = "graph"
        except Exception:
            try:
                stream.end_capture()
            except Exception:
                pass
            run = lambda: [f() for f in launches]  # noqa: E731
            mode = "eager"
        run()
        stream.synchronize()
        times = []
        start, end = cp.cuda.Event(), cp.cuda.Event()
        for _ in range(reps):
            start.record(stream)
            run()
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e-3 / len(launches))
    return statistics.median(times), mode


def _copies(nbytes: int) -> int:
    return max(2, min(64, -(-ROTATE_BYTES // nbytes)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1", help="comma-separated batch sizes, e.g. 1,8,32,64")
    ap.add_argument("--dims", default="7b", help="a key of nanoqwen_kernels.dims.PRESETS")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--no-peer", action="store_true", help="skip the cuBLAS lm_head peer")
    ap.add_argument("--variant", default=None,
                    help="comma-separated GEMV variants to time at every B (default: the default variant)")
    ap.add_argument("--sweep", action="store_true", help="B = 1 on every GEMV variant, not just --variant")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]

    import cupy as cp
    from nanoqwen_kernels import gpu_status, loader
    from nanoqwen_kernels.dims import PRESETS
    from nanoqwen_kernels.gemv import (
        DEFAULT_GEMV_VARIANT,
        DEFAULT_LM_HEAD,
        GEMV_VARIANTS,
        LM_HEAD_BODIES,
        GemvKernels,
    )
    from nanoqwen_kernels.head_i8 import HeadI8Kernels

    ok, why = gpu_status()
    if not ok:
        print(f"bench_gemv: no usable GPU ({why})", file=sys.stderr)
        return 2
    D = PRESETS[args.dims]
    chosen = args.variant.split(",") if args.variant else [DEFAULT_GEMV_VARIANT]
    unknown = [v for v in chosen if v not in GEMV_VARIANTS]
    if unknown:
        print(f"bench_gemv: unknown variant(s) {', '.join(unknown)}; one of {', '.join(GEMV_VARIANTS)}",
              file=sys.stderr)
        return 2
    variants = sorted(set(chosen) | (set(GEMV_VARIANTS) if args.sweep else set()))
    kern = {v: GemvKernels(D, lambda s, defs: loader.load_module(s, defs), v) for v in variants}
    rng = np.random.default_rng(0)
    H, inter, eps = D.hidden, D.intermediate, 1e-6
    bmax = max(batches)

    sets = {}

    def int4_set(n, k):
        if (n, k) not in sets:
            one = n * k // 2 + n * (k // 128) * 2
            c = _copies(one)
            qw = [cp.random.randint(0, 2**31, size=(n, k // 8), dtype=np.int64).astype(np.uint32) for _ in range(c)]
            sc = [cp.asarray((rng.uniform(0.5, 1.5, size=(n, k // 128)) * 0.003).astype(np.float16)) for _ in range(c)]
            sets[(n, k)] = (qw, sc, one)
        return sets[(n, k)]

    x_h = cp.asarray((rng.standard_normal((bmax, H)) * 0.5).astype(np.float16))
    x_i = cp.asarray((rng.standard_normal((bmax, inter)) * 0.1).astype(np.float16))
    nw = cp.asarray(np.ones(H, np.float16))
    rows = []

    def bench(name, part, b, variant, n, k, call, weights, weight_bytes):
        """Time call(*weights[i % copies]) for i < PER_GRAPH. part: "layer" (once per layer), "head"
        (once per step) or "peer" (not in the step's sum)."""
        launches = [functools.partial(call, *weights[i % len(weights)]) for i in range(PER_GRAPH)]
        t, mode = _time_graph(cp, launches, args.reps)
        rows.append(dict(kernel=name, part=part, batch=b, variant=variant, shape=f"{n}x{k}", us=t * 1e6,
                         gbs=weight_bytes / t / 1e9, pct=100 * weight_bytes / t / COPY_BW, mode=mode))

    def rows_of(x, b):
        return x[:b] if b > 1 else x[0]

    V = D.vocab
    lm = [((0.02 * cp.random.standard_normal((V, H), dtype=np.float32)).astype(np.float16),) for _ in range(2)]
    for b in batches:
        lead = (b,) if b > 1 else ()
        xh, xi = rows_of(x_h, b), rows_of(x_i, b)
        pos = cp.asarray((1000 + 37 * np.arange(b)).astype(np.int32))
        max_pages = 256  # covers positions up to 4095
        pt = cp.asarray(np.arange(b * max_pages, dtype=np.int32).reshape(b, max_pages) % (64 * b))
        kc = cp.zeros((1, 64 * b, D.n_kv_heads, 16, 128), dtype=np.float16)
        vc = cp.zeros_like(kc)
        for variant in variants if b == 1 else chosen:
            g = kern[variant]
            for n, k, what in [(H, H, "o_proj+residual"), (H, inter, "down+residual")]:
                qw, sc, one = int4_set(n, k)
                out = cp.zeros((*lead, n), dtype=np.float16)
                call = functools.partial(g.gemv_int4, x=xh if k == H else xi, out=out, residual=out)
                bench(f"gemv_int4 ({what})", "layer", b, variant, n, k, call, list(zip(qw, sc, strict=True)), one)
            qw, sc, one = int4_set(D.qkv_rows, H)
            call = functools.partial(
                g.qkv_rope_kv, bias=cp.zeros(D.qkv_rows, dtype=np.float16), x=xh, norm_w=nw, eps=eps, pos_dev=pos,
                page_table=pt if b > 1 else pt[0], k_cache=kc, v_cache=vc, layer=0,
                q_out=cp.zeros((*lead, D.q_dim), dtype=np.float16),
            )
            bench("qkv_rope_kv (norm+qkv+rope+kv)", "layer", b, variant, D.qkv_rows, H, call, list(zip(qw, sc, strict=True)), one)
            qw, sc, one = int4_set(2 * inter, H)
            call = functools.partial(g.gate_up_silu, x=xh, norm_w=nw, eps=eps,
                                     out=cp.zeros((*lead, inter), dtype=np.float16))
            bench("gate_up_silu (norm+gate/up+silu)", "layer", b, variant, 2 * inter, H, call, list(zip(qw, sc, strict=True)), one)
            call = functools.partial(g.gemv_fp16, x=xh, out=cp.zeros((*lead, V), dtype=np.float32))
            bench("gemv_fp16 (lm_head)", "head", b, variant, V, H, call, lm, V * H * 2)
        if b == 1:  # the int8 lm_head (head_i8.cu; the engine's default head at batch 1)
            hk = HeadI8Kernels(D, lambda s, defs: loader.load_module(s, defs))
            heads = []
            for (w,) in lm:
                q8 = cp.empty((V, H), dtype=np.uint8)
                s8 = cp.empty((V, H // 128), dtype=np.float16)
                hk.quantize_head_i8(w, q8, s8)
                heads.append((q8, s8))
            call = functools.partial(hk.gemv_head_i8, x=xh, out=cp.zeros(V, dtype=np.float32))
            bench("gemv_head_i8 (lm_head int8)", "peer", b, "-", V, H, call, heads, V * H + V * (H // 128) * 2)
        if b > 1:  # the lm_head's other B > 1 body (gemv_mma's passes), beside the default (cuBLAS)
            other = next(h for h in LM_HEAD_BODIES if h != DEFAULT_LM_HEAD)
            gh = GemvKernels(D, lambda s, defs: loader.load_module(s, defs), chosen[0], other)
            call = functools.partial(gh.gemv_fp16, x=xh, out=cp.zeros((*lead, V), dtype=np.float32))
            bench(f"gemv_fp16 (lm_head, {other})", "peer", b, chosen[0], V, H, call, lm, V * H * 2)
        if not args.no_peer:
            call = functools.partial(cp.matmul, x_h[:b], out=cp.zeros((b, V), dtype=np.float16))
            bench("cuBLAS fp16 out (lm_head peer)", "peer", b, "-", V, H, call, [(w.T,) for (w,) in lm], V * H * 2)

    dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    print(f"\nbench_gemv {args.dims} on {dev}: median of {args.reps} graph replays x {PER_GRAPH} launches, "
          f"rotating weights > L2; GB/s = weight bytes / time; % of {COPY_BW / 1e12:.2f} TB/s")
    print(f"{'kernel':34s} {'B':>3s} {'variant':>8s} {'shape':>13s} {'us':>9s} {'GB/s':>7s} {'%copy':>6s} timed")
    for r in rows:
        print(f"{r['kernel']:34s} {r['batch']:3d} {r['variant']:>8s} {r['shape']:>13s} {r['us']:9.2f} "
              f"{r['gbs']:7.0f} {r['pct']:6.1f} {r['mode']}")
    steps = []
    for b in batches:
        for variant in chosen:
            mine = [r for r in rows if r["batch"] == b and r["variant"] == variant]
            layer = sum(r["us"] for r in mine if r["part"] == "layer")
            step = D.n_layers * layer + sum(r["us"] for r in mine if r["part"] == "head")
            steps.append(dict(batch=b, variant=variant, step_us=step, tok_s=b / step * 1e6))
            print(f"step GEMVs at B={b:3d} {variant:>8s}: {step:8.1f} us ({D.n_layers} layers x {layer:.1f} us "
                  f"+ lm_head) -> {b / step * 1e6:9.0f} tok/s bound from the GEMVs alone")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=dev, dims=args.dims, rows=rows, steps=steps), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
