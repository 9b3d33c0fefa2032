"""GPU diagnostic of the tile GEMM's data flow (B > 1): which x element each output actually multiplied.

Weights: row r holds q = 1 at k = r and 0 elsewhere, scale 1, so out[b, r] = x[b, r]. Two probes, x[b, k] = k
(which k was read) and x[b, k] = b + 1 (which column), on the 1.5B's hidden size (1536: every k exact in
fp16). Prints, per batch size, how many outputs are wrong and the first few as (row, col) <- (k, col) read.
A layout bug (a copy offset, a swizzle, a descriptor field, a fragment order) shows as a pattern here where
the random-input tests show only "beyond tolerance". Run with the build's knobs in $NANOQWEN_KERNEL_DEFINES:

    NANOQWEN_KERNEL_DEFINES=NQ_TILE_WGMMA=1 python3 scripts/tile_probe.py
"""

import sys

import cupy as cp
import numpy as np
from nanoqwen_kernels import loader
from nanoqwen_kernels.dims import PRESETS
from nanoqwen_kernels.gemv import GemvKernels

sys.path.insert(0, "packages/nanoqwen-kernels/tests")
from refs import pack_valueshuffle  # noqa: E402


def main() -> int:
    dims = PRESETS["1.5b"]
    k = n = dims.hidden
    u = np.full((n, k), 8, dtype=np.uint8)  # u = q + 8
    u[np.arange(n), np.arange(n) % k] = 9
    scales = np.ones((n, k // 128), dtype=np.float16)
    qw, sc = cp.asarray(pack_valueshuffle(u)), cp.asarray(scales)
    g = GemvKernels(dims, loader.load_module, "tiles")
    bad_total = 0
    for b in (2, 8, 9, 16, 33, 64):
        xk = np.tile(np.arange(k, dtype=np.float16), (b, 1))
        xb = np.tile((np.arange(b, dtype=np.float16) + 1)[:, None], (1, k))
        outs = []
        for x in (xk, xb):
            out = cp.full((b, n), np.nan, dtype=np.float16)
            g.gemv_int4(qw, sc, cp.asarray(x), out)
            outs.append(out.get().astype(np.float64))
        got_k, got_b = outs[0], outs[1] - 1
        want_k = np.tile(np.arange(n) % k, (b, 1)).astype(np.float64)
        want_b = np.tile(np.arange(b)[:, None], (1, n)).astype(np.float64)
        bad = (got_k != want_k) | (got_b != want_b)
        bad_total += int(bad.sum())
        print(f"B={b}: {int(bad.sum())} of {bad.size} outputs wrong")
        for col, row in list(zip(*np.nonzero(bad), strict=True))[:8]:
            print(f"   out[col {col}, row {row}] <- k {got_k[col, row]:g}, col {got_b[col, row]:g}")
    return 1 if bad_total else 0


if __name__ == "__main__":
    sys.exit(main())
