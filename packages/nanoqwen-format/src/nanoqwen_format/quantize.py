"""Symmetric group-wise INT4 quantization (docs/FORMAT.md section "Quantization").

All arithmetic is float32 with IEEE round-to-nearest-even, so an outside reimplementation that follows
FORMAT.md gets bit-identical scales and values:

    s = float16(float32(max|w| over the group) / 7)          (one scale per 128 values along K)
    q = clamp(rint(float32(w) / float32(s)), -8, 7)            (q = 0 where s == 0)
    u = q + 8                                                  (stored nibble, 0..15)
    w' = s * (u - 8)
"""

import numpy as np

from .errors import NanoqwenFormatError

GROUP = 128  # values per scale, along K (the input dimension)
QMIN, QMAX = -8, 7
ZERO = 8  # stored u = q + ZERO


def quantize_int4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w float [N, K] (K % 128 == 0) -> (u uint8 [N, K] in 0..15, scales float16 [N, K/128])."""
    w = np.asarray(w)
    if w.ndim != 2 or w.shape[1] % GROUP != 0:
        raise NanoqwenFormatError(f"quantize_int4 needs a 2-D [N, K] array with K a multiple of {GROUP}, "
                                  f"got shape {w.shape}")
    if not np.issubdtype(w.dtype, np.floating):
        raise NanoqwenFormatError(f"quantize_int4 needs floating-point weights, got {w.dtype}")
    n, k = w.shape
    g = w.astype(np.float32, copy=False).reshape(n, k // GROUP, GROUP)  # [N, K/128, 128]
    # max|w| as max(max, -min): two reductions and no |w| temporary (this function is the converter's
    # hot loop, so every full pass over g counts).
    amax = np.maximum(g.max(axis=2), -g.min(axis=2))  # [N, K/128] float32
    if not np.all(np.isfinite(amax)):
        raise NanoqwenFormatError("quantize_int4: weights contain inf or NaN")
    with np.errstate(over="ignore"):
        scales = (amax / np.float32(7)).astype(np.float16)  # [N, K/128]
    if not np.all(np.isfinite(scales)):
        raise NanoqwenFormatError("quantize_int4: a group's max|w|/7 overflows float16 (|w| > 458528)")
    # s == 0 -> divide by +inf: every finite w/inf is +-0, so q = 0 without a separate select pass.
    s32 = np.where(scales == 0, np.float32(np.inf), scales.astype(np.float32))[:, :, None]  # [N, K/128, 1]
    q = np.divide(g, s32)  # [N, K/128, 128] float32, a fresh buffer the next steps work in
    np.rint(q, out=q)
    np.clip(q, QMIN, QMAX, out=q)
    q += np.float32(ZERO)
    u = q.astype(np.uint8).reshape(n, k)
    return u, scales


def dequantize_int4(u: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """u uint8 [N, K] (0..15), scales float16 [N, K/128] -> float32 [N, K] = s * (u - 8)."""
    n, k = u.shape
    if scales.shape != (n, k // GROUP) or k % GROUP:
        raise NanoqwenFormatError(f"dequantize_int4: scales shape {scales.shape} does not fit values {u.shape}")
    q = u.reshape(n, k // GROUP, GROUP).astype(np.float32) - np.float32(ZERO)
    return (q * scales.astype(np.float32)[:, :, None]).reshape(n, k)
