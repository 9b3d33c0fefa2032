"""Decode attention at batch 1 under other page splits: which (cluster size C, clusters n) grid is fastest at
each context, on the 7B's and the 1.5B's dims (issue 15's attention line and its 32k line).

    PYTHONPATH=packages/nanoqwen-kernels/src python scripts/attention_split_probe.py [--ctx 640,32768] [--variant fma] [--stages 16] [--grids 3] [--grids-spec "7B:8x5,8x4;1.5B:8x9"] [--cluster-max 16]

The launcher sizes the grid as n_kv x C x n blocks from the SM count (attention.py decode_clusters: 7B
(8, 5) = 160 blocks on 132 SMs, the 1.5B (8, 9) = 144), so some SMs hold two blocks of equal work; this
times the kernel with (C, n) forced, the same method as bench/bench_attention.py (a CUDA graph of calls over
layers larger than twice the L2, median of the graph's launches / calls). $NANOQWEN_KERNEL_DEFINES
(e.g. NQ_DECODE_MIN_CLUSTER_PAGES=16) changes the build; run each build in its own process.
A timing is a measurement, never an assertion.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import cupy as cp
import nanoqwen_kernels.attention as attention_mod
import numpy as np
from nanoqwen_kernels.attention import TICKET_WORDS, AttentionKernels
from nanoqwen_kernels.dims import QWEN25_1_5B, QWEN25_7B
from nanoqwen_kernels.loader import load_module

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "packages/nanoqwen-kernels/bench"))
from bench_attention import COPY_TBS, L2_BYTES, time_graph  # noqa: E402

GRIDS = {  # (C, n) per model; the first is the launcher's own choice on 132 SMs
    "7B": [(8, 5), (8, 4), (8, 6), (4, 8), (3, 11), (6, 5), (4, 4)],
    "1.5B": [(8, 9), (8, 8), (6, 11), (4, 16), (8, 16), (4, 8)],
}


def grids_from(spec: str) -> dict:
    """--grids-spec "7B:8x5,8x4;1.5B:8x9": the grids to time per model instead of GRIDS."""
    out = {}
    for part in spec.split(";"):
        label, grids = part.split(":")
        out[label.strip()] = [tuple(int(v) for v in g.split("x")) for g in grids.split(",")]
    return out


def one_sequence(d, ctx: int) -> dict:
    """A batch of one sequence of ctx tokens, its pages scattered, over enough layers that a graph cycling
    through them reads more than twice the L2 (each call's K/V from DRAM): k, v, table, seq, q, n_layers,
    kv_bytes (one layer's K/V)."""
    kv_bytes = ctx * d.n_kv_heads * 128 * 2 * 2
    n_layers = max(2, -(-2 * L2_BYTES // kv_bytes))
    per_seq = (ctx + 15) // 16
    shape = (n_layers, per_seq, d.n_kv_heads, 16, 128)
    return {
        "k": cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16),
        "v": cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16),
        "table": cp.asarray(np.random.default_rng(0).permutation(per_seq).astype(np.int32)),
        "seq": cp.asarray(np.array([ctx], np.int32)),
        "q": cp.random.standard_normal((1, d.n_heads * 128), dtype=cp.float32).astype(cp.float16),
        "n_layers": n_layers,
        "kv_bytes": kv_bytes,
    }


def probe(dims, label: str, ctx: int, grids, variant: str, cluster_max: int = 8) -> None:
    d = dims
    ak = AttentionKernels(d, load_module, variant, cluster_max=cluster_max)
    one = one_sequence(d, ctx)
    k, v, table, seq, q = one["k"], one["v"], one["table"], one["seq"], one["q"]
    n_layers, kv_bytes = one["n_layers"], one["kv_bytes"]
    ref = None
    for c, n in grids:
        ak.clusters = lambda b, c=c, n=n: (c, n)  # the grid forced; workspace sized for the largest
        ak._flagged.clear()  # the fold's choice asked again for this grid
        ws = cp.zeros(TICKET_WORDS + 16 * d.n_heads * 128 * (1 + 16 * 2), cp.float32)  # n <= 16, C <= 16
        out = cp.full((1, d.n_heads * 128), np.nan, cp.float16)
        ak.attention_decode(q, k, v, table, seq, 0, out, ws)
        cp.cuda.Device().synchronize()
        o = cp.asnumpy(out).astype(np.float32)
        if ref is None:
            ref = o
        err = float(np.abs(o - ref).max())
        t = time_graph(
            lambda i, out=out, ws=ws: ak.attention_decode(q, k, v, table, seq, i % n_layers, out, ws),
            4 * n_layers,
        )
        gbs = kv_bytes / t / 1e9
        print(
            f"| {label} | {ctx} | C={c} n={n} ({d.n_kv_heads * c * n} blocks{', flagged' if ak.flagged_fold(1) else ''}) | {t * 1e6:.2f} | "
            f"{100 * gbs / (COPY_TBS * 1e3):.1f}% | {err:.1e} |",
            flush=True,
        )


def main() -> int:
    ctxs = [640, 1024, 4096, 16384, 32768]
    if "--ctx" in sys.argv:
        ctxs = [int(x) for x in sys.argv[sys.argv.index("--ctx") + 1].split(",")]
    if "--stages" in sys.argv:  # the ring's depth: the launcher's constant, so smem and defines agree
        attention_mod.DECODE_STAGES = int(sys.argv[sys.argv.index("--stages") + 1])
    variant = sys.argv[sys.argv.index("--variant") + 1] if "--variant" in sys.argv else "mma"
    # --cluster-max 16: the long-context build (attention.LONG_CLUSTER_MAX; grids of C <= 16)
    cmax = int(sys.argv[sys.argv.index("--cluster-max") + 1]) if "--cluster-max" in sys.argv else 8
    n_grids = int(sys.argv[sys.argv.index("--grids") + 1]) if "--grids" in sys.argv else None  # the first N
    grids = grids_from(sys.argv[sys.argv.index("--grids-spec") + 1]) if "--grids-spec" in sys.argv else GRIDS
    print(
        f"variant {variant}, stages {attention_mod.DECODE_STAGES}, defines: {os.environ.get('NANOQWEN_KERNEL_DEFINES', '')!r}"
    )
    print("| dims | context | grid | us | % of copy | max diff vs first grid |")
    print("| --- | --- | --- | --- | --- | --- |")
    for dims, label in ((QWEN25_7B, "7B"), (QWEN25_1_5B, "1.5B")):
        if label not in grids:
            continue
        for ctx in ctxs:
            probe(dims, label, ctx, grids[label][:n_grids], variant, cmax)
    return 0


if __name__ == "__main__":
    sys.exit(main())
