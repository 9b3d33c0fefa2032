"""ValueShuffle-v1: the nibble order inside each 32-bit word that the INT4 GEMV unpacks with prmt.b32.

Word w of a row holds the 8 stored values u[k..k+7], k = 8w (words in k order, little-endian):

     bit: 31..28 27..24 23..20 19..16 15..12 11..8  7..4   3..0
          u[k+7] u[k+3] u[k+6] u[k+2] u[k+5] u[k+1] u[k+4] u[k+0]
     byte i (i = 0..3) = u[k+i] | u[k+4+i] << 4

Why: `w & 0x0F0F0F0F` holds u[k+0..3] one per byte and `(w >> 4) & 0x0F0F0F0F` holds u[k+4..7], so one
prmt.b32 with 0x64 bytes builds the half2 {1024+u[k], 1024+u[k+1]} and a single hsub2 gives exact fp16 q
pairs in k order (docs/INTERFACES.md section 2). Worked example: u = 0,1,...,7 -> 0x73625140.
"""

import numpy as np

from .errors import NanoqwenFormatError


def pack_valueshuffle(u: np.ndarray) -> np.ndarray:
    """u uint8 [N, K] in 0..15 (K % 8 == 0) -> words uint32 [N, K/8] (little-endian)."""
    u = np.asarray(u)
    if u.ndim != 2 or u.shape[1] % 8 != 0:
        raise NanoqwenFormatError(f"pack_valueshuffle needs [N, K] with K a multiple of 8, got {u.shape}")
    if u.size and (u.min() < 0 or u.max() > 15):
        raise NanoqwenFormatError("pack_valueshuffle: values must be in 0..15")
    n, k = u.shape
    v = u.astype(np.uint8, copy=False).reshape(n, k // 8, 8)  # [N, K/8, 8]
    b = v[:, :, 0:4] | (v[:, :, 4:8] << 4)  # [N, K/8, 4] byte i = u[k+i] | u[k+4+i] << 4
    return np.ascontiguousarray(b).view("<u4").reshape(n, k // 8).astype(np.uint32, copy=False)


def unpack_valueshuffle(words: np.ndarray) -> np.ndarray:
    """words uint32 [N, K/8] -> u uint8 [N, K] in 0..15 (exact inverse of pack_valueshuffle)."""
    words = np.asarray(words)
    if words.ndim != 2 or words.dtype != np.uint32:
        raise NanoqwenFormatError(f"unpack_valueshuffle needs uint32 [N, K/8], got {words.dtype} {words.shape}")
    n, kw = words.shape
    b = np.ascontiguousarray(words, dtype="<u4").view(np.uint8).reshape(n, kw, 4)  # [N, K/8, 4]
    return np.concatenate([b & 0x0F, b >> 4], axis=2).reshape(n, kw * 8)
