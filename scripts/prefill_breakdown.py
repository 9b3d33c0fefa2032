"""Where a prompt's prefill time goes: every kernel launcher call of one prefill timed with CUDA events on
the engine's stream, summed per kernel (the GEMMs per matrix), beside the whole prefill's wall time and
each family's TFLOP/s (GEMMs: 2 T N K; attention: the causal pairs' 4 x 128 flops per head).

    python3 scripts/prefill_breakdown.py MODEL.nanoqwen [--tokens 512,8192,32768] [--json out.json]

The prefill runs eagerly (no prefill graphs: their launches cannot be timed one by one), so at short
prompts the wall time includes the Python launches the graphs would remove; the kernel times do not.
An event pair per launch adds a few microseconds of host time, not GPU time. Needs a GPU (CuPy).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict

import numpy as np


class _Timed:
    """A KernelSet stand-in: each launcher call runs between two CUDA events, recorded under a name."""

    def __init__(self, ks, cp, names_of):
        self._ks, self._cp, self._names_of = ks, cp, names_of
        self.records: list[tuple[str, object, object]] = []

    def __getattr__(self, attr):
        fn = getattr(self._ks, attr)
        if not callable(fn):
            return fn

        def timed(*args, **kwargs):
            start, end = self._cp.cuda.Event(), self._cp.cuda.Event()
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self.records.append((self._names_of(attr, args), start, end))
            return out

        return timed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", default="512,8192,32768", help="comma-separated prompt lengths")
    ap.add_argument("--chunks", default=None,
                    help="comma-separated pass sizes to try (the backend's PREFILL_CHUNK, rows per pass)")
    ap.add_argument("--prefill-weights", default=None, choices=["auto", "fp16", "int4", "fp8"],
                    help="the engine's prefill_weights (default: $NANOQWEN_PREFILL_WEIGHTS, else auto)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]

    import cupy as cp
    from nanoqwen_engine import Engine
    from nanoqwen_engine.cuda import prefill as prefill_mod

    chunks = [int(c) for c in args.chunks.split(",")] if args.chunks else [prefill_mod.PREFILL_CHUNK]

    eng = Engine.load(args.model, device="cuda", max_context=max(lengths) + 64, progress=False,
                      prefill_weights=args.prefill_weights)
    be = eng.backend
    cfg, pp = be.config, be.prefill_pass
    pp.graphs = False
    H, inter, R = cfg.hidden, cfg.intermediate, (cfg.n_heads + 2 * cfg.n_kv_heads) * 128
    by_n = {R: "qkv", H: None, 2 * inter: "gate_up"}

    def names_of(attr: str, a: tuple) -> str:
        if attr in ("gemm_f16", "gemm_int4_wg", "gemm_fp8"):
            w = a[0]
            n, k = int(w.shape[0]), int(w.shape[1]) * (8 if attr == "gemm_int4_wg" else 1)
            name = by_n.get(n) or ("o" if k == H else "down")
            return f"{attr} {name}"
        return attr

    rng = np.random.default_rng(0)
    rows = []
    for T, chunk in [(T, c) for T in lengths for c in chunks]:
        prefill_mod.PREFILL_CHUNK = chunk
        ids = rng.integers(0, cfg.vocab, size=T).astype(np.int32)
        seq = be.pool.new_sequence()  # warm-up: every kernel loaded, the buffers of this length allocated
        be.prefill(seq, ids, None)
        be.pool.free(seq)
        timed = _Timed(pp.ks, cp, names_of)
        pp.ks = timed
        seq = be.pool.new_sequence()
        be.dev.synchronize()
        t0 = time.perf_counter()
        be.prefill(seq, ids, None)
        be.dev.synchronize()
        wall = time.perf_counter() - t0
        pp.ks = timed._ks
        be.pool.free(seq)
        per = defaultdict(lambda: [0, 0.0])
        for name, s, e in timed.records:
            per[name][0] += 1
            per[name][1] += cp.cuda.get_elapsed_time(s, e) * 1e-3
        flops = {"qkv": 2.0 * T * R * H, "o": 2.0 * T * H * cfg.n_heads * 128, "gate_up": 2.0 * T * 2 * inter * H,
                 "down": 2.0 * T * H * inter}
        attn_flops = 4.0 * 128 * cfg.n_heads * T * (T + 1) / 2  # causal pairs, one layer
        kern = sum(t for _, t in per.values())
        gpu = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
        print(f"\nprefill {T} tokens in passes of <= {chunk} rows, {gpu}: wall {wall * 1e3:.1f} ms, "
              f"kernels {kern * 1e3:.1f} ms ({len(timed.records)} launches)")
        print(f"{'kernel':28s} {'calls':>6s} {'ms':>9s} {'share':>6s} {'TFLOP/s':>8s}")
        for name, (calls, t) in sorted(per.items(), key=lambda kv: -kv[1][1]):
            tf = ""
            mat = name.split(" ")[-1]
            if name.startswith("gemm") and mat in flops:
                tf = f"{flops[mat] * cfg.n_layers / t / 1e12:8.0f}"
            elif name in ("gemm_int4_wg_silu", "gemm_fp8_silu"):
                tf = f"{flops['gate_up'] * cfg.n_layers / t / 1e12:8.0f}"
            elif name == "attention_prefill":
                tf = f"{attn_flops * cfg.n_layers / t / 1e12:8.0f}"
            print(f"{name:28s} {calls:6d} {t * 1e3:9.2f} {t / kern:6.1%} {tf:>8s}")
            rows.append(dict(tokens=T, chunk=chunk, kernel=name, calls=calls, ms=t * 1e3, wall_ms=wall * 1e3))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
