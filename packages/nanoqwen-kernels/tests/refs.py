"""numpy references and packers for the kernel tests (kept beside the tests, not in the package).

Written from the contracts (docs/INTERFACES.md sections 2-4) and HF Qwen2's math, independently of the
kernels: the ValueShuffle packer below is checked against the contract's worked example on the CPU.
"""

from __future__ import annotations

import numpy as np

GROUP = 128


def pack_valueshuffle(u: np.ndarray) -> np.ndarray:
    """u uint8 [N, K] in 0..15 -> uint32 [N, K/8]: byte i of word w = u[8w+i] | u[8w+4+i] << 4."""
    n, k = u.shape
    v = u.reshape(n, k // 8, 8)
    b = np.ascontiguousarray(v[..., :4] | (v[..., 4:] << 4), dtype=np.uint8)  # [N, K/8, 4] bytes
    return b.view("<u4").reshape(n, k // 8).astype(np.uint32)  # byte i is bits 8i..8i+7


def random_int4(rng: np.random.Generator, n: int, k: int, scale: float = 0.02):
    """Random stored values u and fp16 group scales: W = s * (u - 8), like a quantized N(0, scale)."""
    u = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    s = (rng.uniform(0.5, 1.5, size=(n, k // GROUP)) * scale / 7).astype(np.float16)
    return u, s


def dequant(u: np.ndarray, s: np.ndarray) -> np.ndarray:
    """float32 [N, K]."""
    n, k = u.shape
    q = u.astype(np.float32) - 8.0
    return (q.reshape(n, k // GROUP, GROUP) * s.astype(np.float32)[..., None]).reshape(n, k)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """HF Qwen2RMSNorm on fp16 rows: fp32 mean of squares, fp16(x*r), then fp16(w * that)."""
    xf = x.astype(np.float32)
    r = 1.0 / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + np.float32(eps))
    xn = (xf * r).astype(np.float16)
    return (w.astype(np.float32) * xn.astype(np.float32)).astype(np.float16)


def gemv_tolerance(wd: np.ndarray, xin: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per-row bound for the INT4 GEMV: products and 4-term partial sums are fp16 (rel. 2^-11 each), so
    the error scales with sqrt(sum (w x)^2); the fp16 output adds 2^-11 |ref|. 8x headroom over that.
    xin [K] with ref [N], or a batch: xin [B, K] with ref [B, N]."""
    xf = xin.astype(np.float32)
    spread = np.sqrt(np.square(xf) @ np.square(wd).T).astype(np.float64)
    return 8 * 2.0**-11 * (np.abs(ref) + 3 * spread) + 1e-6


def matvec(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float64 [N] = w @ x through a float32 BLAS matmul (its error, ~1e-7 of sqrt(sum (w x)^2), is far
    below every kernel tolerance; a float64 product of a 37888 x 3584 matrix would be needlessly slow)."""
    return (w.astype(np.float32, copy=False) @ x.astype(np.float32)).astype(np.float64)


def rope_angles(pos, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [..., 64] for frequency d at position pos (an int, or an array of positions): inv_freq
    correctly rounded to fp32, angle = pos * inv in fp32 (HF's math; the engine's reference and both GPU
    paths, decode and prefill, compute inv_freq the same way)."""
    inv = (1.0 / (np.float64(np.float32(theta)) ** (np.arange(0, 128, 2, dtype=np.float64) / 128))).astype(
        np.float32
    )
    ang = np.multiply.outer(np.asarray(pos, np.float32), inv).astype(np.float32).astype(np.float64)
    return np.cos(ang), np.sin(ang)


def rope(v: np.ndarray, pos, theta: float) -> np.ndarray:
    """HF rotate-half on [heads, 128] float64 at position pos, or on [T, heads, 128] at positions pos [T]."""
    c, s = rope_angles(pos, theta)
    c, s = c[..., None, :], s[..., None, :]
    a, b = v[..., :64], v[..., 64:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def scattered_pages(rng: np.random.Generator, n_tokens: int, spare: int = 5) -> tuple[np.ndarray, int]:
    """A page table for n_tokens positions over a pool with `spare` more pages, in random order (so a
    kernel that assumes contiguous pages reads the wrong ones): (table int32 [ceil(n/16)], pool pages)."""
    n_logical = -(-n_tokens // 16)
    n_pages = n_logical + spare
    return rng.permutation(n_pages)[:n_logical].astype(np.int32), n_pages
