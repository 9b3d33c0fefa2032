"""Launch one batched GEMV a few times with random 7B-shaped weights, for a profiler to attach to
(e.g. `ncu --kernel-name regex:tile --launch-skip 2 --launch-count 1 python3 scripts/profile_gemv.py`).

    python3 scripts/profile_gemv.py [--kind gu|h|i|qkv] [--batch 64] [--variant tiles]
"""

import argparse

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="gu", choices=["gu", "h", "i"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--variant", default="tiles")
    ap.add_argument("--launches", type=int, default=5)
    a = ap.parse_args()
    import cupy as cp
    from nanoqwen_kernels import loader
    from nanoqwen_kernels.dims import QWEN25_7B as D
    from nanoqwen_kernels.gemv import GemvKernels

    g = GemvKernels(D, lambda s, d: loader.load_module(s, d), a.variant)
    n, k = {"gu": (2 * D.intermediate, D.hidden), "h": (D.hidden, D.hidden), "i": (D.hidden, D.intermediate)}[a.kind]
    qw = cp.random.randint(0, 2**31, size=(n, k // 8), dtype=np.int64).astype(np.uint32)
    sc = cp.asarray((np.random.default_rng(0).uniform(0.5, 1.5, size=(n, k // 128)) * 0.003).astype(np.float16))
    x = (cp.random.standard_normal((a.batch, k), dtype=np.float32) * 0.5).astype(np.float16)
    for _ in range(a.launches):
        if a.kind == "gu":
            out = cp.empty((a.batch, D.intermediate), dtype=np.float16)
            g.gate_up_silu(qw, sc, x, cp.ones(k, dtype=np.float16), 1e-6, out)
        else:
            out = cp.empty((a.batch, n), dtype=np.float16)
            g.gemv_int4(qw, sc, x, out)
    cp.cuda.Device().synchronize()
    print("ok", a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
