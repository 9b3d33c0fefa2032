"""Where the host time of a prefill goes: a short prompt's prefill is launch-bound (every launcher call
checks its arguments and launches eagerly), so this times N prefills of a T-token prompt wall-clock, then
runs them again under cProfile and prints the functions with the most own time, and a few single launcher
calls timed alone (host microseconds per call, the GPU idle).

    python scripts/profile_prefill_host.py MODEL.nanoqwen [--tokens 1] [--reps 20] [--top 30]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()

    from nanoqwen_engine import Engine
    from nanoqwen_engine.params import SamplingParams
    from nanoqwen_engine.sampler import SamplerState

    eng = Engine.load(args.model, device="cuda", max_context=4096, progress=False)
    be = eng.backend
    rng = np.random.default_rng(0)
    ids = rng.integers(0, be.config.vocab, size=args.tokens).astype(np.int32)
    greedy = SamplingParams(temperature=0.0).resolve({})

    def once():
        seq = be.pool.new_sequence()
        be.prefill(seq, ids, SamplerState(greedy, be.config.vocab))  # returns the token: synchronised
        be.pool.free(seq)

    for _ in range(3):
        once()
    t = time.perf_counter()
    for _ in range(args.reps):
        once()
    ms = (time.perf_counter() - t) / args.reps * 1e3
    print(f"prefill of {args.tokens} tokens: {ms:.2f} ms wall (mean of {args.reps})")

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.reps):
        once()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
    print(s.getvalue())

    # single launcher calls, host time only (the same buffers every call)
    ks, w, c = be.ks, be.w, be.config
    import cupy as cp

    x = cp.zeros((args.tokens, c.hidden), dtype=np.float16)
    h = cp.zeros_like(x)
    lw = w.layers[0]
    dense = be.prefill_pass.dense
    out = cp.zeros((args.tokens, c.qkv_rows), dtype=np.float16)
    calls = {
        "rmsnorm_rows": lambda: ks.rmsnorm_rows(x, lw.in_norm, h, c.rms_eps),
        "gemm_f16 qkv": (lambda: ks.gemm_f16(dense[0].qkv, h, out)) if dense else None,
        # the engine's INT4 path (the fused GEMM; the pass's split-K scratch as its workspace)
        "gemm_int4_wg qkv": lambda: ks.gemm_int4_wg(lw.qkv.qweight, lw.qkv.scales, h, out,
                                                    workspace=be.prefill_pass._gemm_workspace()),
    }
    for name, fn in calls.items():
        if fn is None:
            continue
        fn()
        cp.cuda.get_current_stream().synchronize()
        n = 200
        t = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t) / n * 1e6
        cp.cuda.get_current_stream().synchronize()
        print(f"{name:16s} {host:7.1f} us host per call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
