"""GEMV microbenchmark: the part-A decode kernels at the 7B's shapes, against the copy bandwidth and
a cuBLAS peer (CuPy's own fp16 matrix-vector product on the same shapes).

    PYTHONPATH=packages/nanoqwen-kernels/src python packages/nanoqwen-kernels/bench/bench_gemv.py

Method (DESIGN.md, Performance): each kernel is launched `PER_GRAPH` times inside one captured CUDA
graph, cycling through enough copies of its weights that the bytes between two reads of the same copy
exceed the L2 (so every launch streams from HBM, as in a decode step); the graph is timed with CUDA
events `reps` times and the median / PER_GRAPH is the per-launch time. In-graph timing is how the
kernels run in the engine (one graph per token), and it excludes the ~5 us of an eager Python launch.
Bytes = everything the kernel must read or write once (weights + scales + activations + outputs).
A timing is printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np

COPY_BW = 4.19e12  # B/s, measured copy bandwidth of the H200 here (DESIGN.md)
ROTATE_BYTES = 256 << 20  # weights cycled per graph: > 4x the 50-60 MB L2
PER_GRAPH = 20


def _time_graph(cp, launches, reps: int) -> tuple[float, str]:
    """Median seconds per launch of `launches` (a list of callables) replayed in one graph, and how it
    was timed: "graph", or "eager" when the launches could not be captured (then Python's launch cost
    is in the figure)."""
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
        except Exception:  # a peer that cannot be captured is timed eagerly instead
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
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--no-peer", action="store_true", help="skip the cuBLAS peer")
    ap.add_argument("--sweep", action="store_true", help="also time the INT4 GEMVs' tensor-core variants")
    args = ap.parse_args(argv)

    import cupy as cp
    from nanoqwen_kernels import gpu_status, loader
    from nanoqwen_kernels.dims import QWEN25_7B as D
    from nanoqwen_kernels.gemv import GemvKernels

    ok, why = gpu_status()
    if not ok:
        print(f"bench_gemv: no usable GPU ({why})", file=sys.stderr)
        return 2
    g = GemvKernels(D, lambda s, defs: loader.load_module(s, defs))
    rng = np.random.default_rng(0)
    H, inter = D.hidden, D.intermediate
    eps = 1e-6

    def int4_set(n, k):
        one = n * k // 2 + n * (k // 128) * 2
        c = _copies(one)
        qw = [
            cp.random.randint(0, 2**31, size=(n, k // 8), dtype=np.int64).astype(np.uint32) for _ in range(c)
        ]
        sc = [
            cp.asarray((rng.uniform(0.5, 1.5, size=(n, k // 128)) * 0.003).astype(np.float16))
            for _ in range(c)
        ]
        return qw, sc, one

    x_h = cp.asarray(rng.standard_normal(H).astype(np.float16))
    x_i = cp.asarray(rng.standard_normal(inter).astype(np.float16))
    nw = cp.asarray(np.ones(H, np.float16))
    rows = []

    def bench(name, n, k, launches_of, nbytes, target):
        t, mode = _time_graph(cp, [launches_of(i) for i in range(PER_GRAPH)], args.reps)
        rows.append(
            dict(
                kernel=name,
                shape=f"{n}x{k}",
                us=t * 1e6,
                gbs=nbytes / t / 1e9,
                pct=100 * nbytes / t / COPY_BW,
                target=target,
                mode=mode,
            )
        )

    sets = {}

    def cached_set(n, k):
        if (n, k) not in sets:
            sets[(n, k)] = int4_set(n, k)
        return sets[(n, k)]

    def int4_rows(g, label=""):
        for n, k, what in [(H, H, "o_proj"), (D.kv_dim, H, "k/v_proj"), (H, inter, "down+residual")]:
            qw, sc, one = cached_set(n, k)
            x = x_h if k == H else x_i
            out = cp.zeros(n, dtype=np.float16)
            res = out if what.endswith("residual") else None
            bench(
                f"gemv_int4 ({what}){label}",
                n,
                k,
                lambda i, qw=qw, sc=sc, x=x, out=out, res=res: (
                    lambda: g.gemv_int4(qw[i % len(qw)], sc[i % len(sc)], x, out, residual=res)
                ),
                one + 2 * k + 2 * n * (2 if res is not None else 1),
                85,
            )

        qw, sc, one = cached_set(D.qkv_rows, H)
        bias = cp.zeros(D.qkv_rows, dtype=np.float16)
        pos = cp.asarray([1000], dtype=np.int32)
        pt = cp.arange(64, dtype=np.int32)
        kc = cp.zeros((1, 64, D.n_kv_heads, 16, 128), dtype=np.float16)
        vc = cp.zeros_like(kc)
        q = cp.zeros(D.q_dim, dtype=np.float16)
        bench(
            f"qkv_rope_kv (norm+qkv+rope+kv){label}",
            D.qkv_rows,
            H,
            lambda i: (
                lambda: g.qkv_rope_kv(
                    qw[i % len(qw)], sc[i % len(sc)], bias, x_h, nw, eps, pos, pt, kc, vc, 0, q
                )
            ),
            one + 6 * H + 2 * D.qkv_rows,
            85,
        )

        qg, sg, oneg = cached_set(2 * inter, H)
        act = cp.zeros(inter, dtype=np.float16)
        bench(
            f"gate_up_silu (norm+gate/up+silu){label}",
            2 * inter,
            H,
            lambda i: lambda: g.gate_up_silu(qg[i % len(qg)], sg[i % len(sg)], x_h, nw, eps, act),
            oneg + 4 * H + 2 * inter,
            85,
        )

    int4_rows(g)
    if args.sweep:  # the opt-in tensor-core variants of gemv_int4_mma.cuh
        for label, tuning in (
            (" [mma]", {"NQ_GEMV_MMA": 1}),
            (" [mma+off]", {"NQ_GEMV_MMA": 1, "NQ_GEMV_MMA_OFFSET": 1}),
        ):
            gs = GemvKernels(D, lambda s, defs: loader.load_module(s, defs), tuning)
            int4_rows(gs, label)
    sets.clear()

    V = D.vocab
    lm = [(0.02 * cp.random.standard_normal((V, H), dtype=np.float32)).astype(np.float16) for _ in range(2)]
    logits = cp.zeros(V, dtype=np.float32)
    bench(
        "gemv_fp16 (lm_head)",
        V,
        H,
        lambda i: lambda: g.gemv_fp16(lm[i % 2], x_h, logits),
        V * H * 2 + 2 * H + 4 * V,
        90,
    )
    lm.clear()  # free 2.2 GB before the peers

    peers = []
    if not args.no_peer:
        for n, k in [(H, H), (D.kv_dim, H), (2 * inter, H), (H, inter), (V, H)]:
            one = n * k * 2
            c = _copies(one)
            ws = [cp.random.standard_normal((n, k), dtype=np.float32).astype(np.float16) for _ in range(c)]
            x = x_h if k == H else x_i
            o = cp.zeros(n, dtype=np.float16)
            t, mode = _time_graph(
                cp,
                [(lambda w=ws[i % c], x=x, o=o: cp.matmul(w, x, out=o)) for i in range(PER_GRAPH)],
                args.reps,
            )
            peers.append(
                dict(
                    kernel="cuBLAS fp16 (cupy.matmul)",
                    shape=f"{n}x{k}",
                    us=t * 1e6,
                    gbs=(one + 2 * k + 2 * n) / t / 1e9,
                    pct=100 * (one + 2 * k + 2 * n) / t / COPY_BW,
                    target=None,
                    mode=mode,
                )
            )
            del ws

    dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    print(
        f"\nbench_gemv on {dev}: median of {args.reps} graph replays x {PER_GRAPH} launches, rotating weights "
        f"> L2; % of {COPY_BW / 1e12:.2f} TB/s"
    )
    print(f"{'kernel':36s} {'shape':>13s} {'us':>8s} {'GB/s':>7s} {'%copy':>6s} {'target':>6s} timed")
    for r in rows + peers:
        tgt = f">={r['target']}" if r["target"] else ""
        print(
            f"{r['kernel']:36s} {r['shape']:>13s} {r['us']:8.2f} {r['gbs']:7.0f} {r['pct']:6.1f} {tgt:>6s} "
            f"{r['mode']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=dev, rows=rows, peers=peers), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
