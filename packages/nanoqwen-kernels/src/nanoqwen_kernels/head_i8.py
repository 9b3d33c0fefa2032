"""The lm_head in INT8: its quantizer, its dequantizer and its batch-1 GEMV (cuda/head_i8.cu), with the
numpy twins every CPU path uses (the engine's reference backend and its host stand-ins).

Why: at batch 1 the lm_head is the single largest read of a decode step: the 7B's [152064, 3584] fp16
matrix is 1.09 GB of the step's 4.46 GB (265 us of a 1.63 ms step at 99% of the copy bandwidth), the
1.5B's [151936, 1536] 0.47 GB of 1.16 GB. Stored as int8 with one fp16 scale per 128 values along K it is
half that (the step's floor falls by 0.27 GB on the 7B), and the rounding is finer than the Q6_K that
llama.cpp's Q4_K_M files ship their output matrix in (6.56 bits a weight).

Layout (row-major like the fp16 matrix, so the GEMV walks each row in 16-byte pieces):
    q  uint8 [N, K]        offset binary: byte = q + 128, q in -127..127 (the kernel turns a byte b
                           into the float 8388608 + b with one byte permute, then subtracts 8388736)
    s  float16 [N, K/128]  s = fp16(amax / 127) over the group's 128 values; w' = s * q
Quantizer (quantize_head_i8, the kernel's rule bit for bit): amax in fp32 over the group's fp16 values,
s = fp16(amax / 127) rounded to nearest, q = rint(w / float(s)) (IEEE division, ties to even) clamped
to -127..127, and q = 0 where s is 0 (an all-zero group, or one too small for an fp16 scale).

The engine multiplies these values on every path: at batch 1 this GEMV (fp32 sums of q * x, times s per
group), at batch 2 and more the fp16 copy dequantize_head_i8 makes (fp16(s * q): s * q is exact in fp32,
then rounded once) through cuBLAS, and the CPU reference s * q in fp32.
"""

from __future__ import annotations

import numpy as np

from . import checks as ck
from .errors import KernelError

GROUP = 128  # values per scale along K
OFFSET = 128  # stored byte = q + OFFSET
_ROWS_PER_CHUNK = 8192  # numpy twins work in row chunks (a 7B head in fp32 at once is 2.2 GB)


def _check_k(k: int, what: str) -> None:
    if k % GROUP:
        raise KernelError(f"{what}: K = {k} is not a multiple of {GROUP}")


def quantize_head_i8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q uint8 [N, K] offset binary, s float16 [N, K/128]) of an fp16 matrix w [N, K]: the rule of the
    module doc, which the GPU quantizer follows bit for bit."""
    w = np.asarray(w)
    if w.ndim != 2 or w.dtype != np.float16:
        raise KernelError(f"quantize_head_i8: w must be a 2-D float16 array, got {w.dtype} {w.shape}")
    n, k = w.shape
    _check_k(k, "quantize_head_i8")
    q = np.empty((n, k), dtype=np.uint8)
    s = np.empty((n, k // GROUP), dtype=np.float16)
    for a in range(0, n, _ROWS_PER_CHUNK):
        g = w[a : a + _ROWS_PER_CHUNK].astype(np.float32).reshape(-1, k // GROUP, GROUP)
        amax = np.abs(g).max(axis=-1)
        s16 = (amax / np.float32(127)).astype(np.float16)
        sf = s16.astype(np.float32)[..., None]
        ok = sf > 0
        qq = np.where(ok, np.clip(np.rint(g / np.where(ok, sf, np.float32(1))), -127, 127), np.float32(0))
        q[a : a + _ROWS_PER_CHUNK] = (qq.astype(np.int16) + OFFSET).astype(np.uint8).reshape(-1, k)
        s[a : a + _ROWS_PER_CHUNK] = s16
    return q, s


def dequantize_head_i8(q: np.ndarray, s: np.ndarray, dtype=np.float32) -> np.ndarray:
    """s * (q - 128) as `dtype` [N, K]: float32 exactly (the reference's values), float16 rounded once (the
    GPU's copy for batches of 2 and more; the kernel nq_dequantize_head_i8 gives the same bits)."""
    q, s = np.asarray(q), np.asarray(s)
    if q.ndim != 2 or q.dtype != np.uint8 or s.dtype != np.float16 or s.shape != (q.shape[0], q.shape[1] // GROUP):
        raise KernelError(f"dequantize_head_i8: expected q uint8 [N, K] and s float16 [N, K/128], got "
                          f"{q.dtype} {q.shape} and {s.dtype} {s.shape}")
    _check_k(q.shape[1], "dequantize_head_i8")
    out = np.empty(q.shape, dtype=dtype)
    n, k = q.shape
    for a in range(0, n, _ROWS_PER_CHUNK):
        qq = q[a : a + _ROWS_PER_CHUNK].astype(np.float32).reshape(-1, k // GROUP, GROUP) - np.float32(OFFSET)
        out[a : a + _ROWS_PER_CHUNK] = (qq * s[a : a + _ROWS_PER_CHUNK].astype(np.float32)[..., None]).reshape(-1, k)
    return out


def head_i8_logits(q: np.ndarray, s: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float32 logits [B, N] (or [N] for a 1-D x) of x [B, K] against the int8 head, in float32: what the
    GPU's GEMV computes up to the order of its sums."""
    x = np.asarray(x, dtype=np.float32)
    xb = x[None, :] if x.ndim == 1 else x
    n = q.shape[0]
    out = np.empty((xb.shape[0], n), dtype=np.float32)
    for a in range(0, n, _ROWS_PER_CHUNK):
        out[:, a : a + _ROWS_PER_CHUNK] = xb @ dequantize_head_i8(q[a : a + _ROWS_PER_CHUNK], s[a : a + _ROWS_PER_CHUNK]).T
    return out[0] if x.ndim == 1 else out


SOURCES = ["head_i8.cu"]
THREADS = 256
WARPS = THREADS // 32


class HeadI8Kernels:
    """The int8 lm_head's launchers for one ModelDims (K = hidden); `load_module(sources, defines)` is the
    loader's. Every bad argument is one KernelError naming it, before anything reaches the GPU."""

    def __init__(self, dims, load_module):
        self.dims = dims
        m = load_module(SOURCES, dims.defines())
        self._gemv = m.get_function("nq_gemv_head_i8")
        self._quant = m.get_function("nq_quantize_head_i8")
        self._dequant = m.get_function("nq_dequantize_head_i8")

    def _qs(self, q, s) -> int:
        h = self.dims.hidden
        ck.check_array("q", q, np.uint8, align=16)
        if q.ndim != 2 or q.shape[1] != h or q.shape[0] < 1:
            raise KernelError(f"q must be [N, {h}] uint8, got {tuple(q.shape)}")
        n = int(q.shape[0])
        ck.check_array("s", s, np.float16, (n, h // GROUP))
        return n

    def _items_grid(self, n: int) -> int:
        return -(-(n * (self.dims.hidden // GROUP)) // WARPS)  # a warp per (row, group)

    def quantize_head_i8(self, w, q_out, s_out) -> None:
        """q_out, s_out = quantize_head_i8(w) on the device (the same bits as the numpy twin)."""
        n = self._qs(q_out, s_out)
        ck.check_array("w", w, np.float16, (n, self.dims.hidden), align=16)
        ck.launch(self._quant, self._items_grid(n), THREADS, (w, q_out, s_out, np.int32(n)))

    def dequantize_head_i8(self, q, s, out) -> None:
        """out fp16 [N, H] = fp16(s * (q - 128)) (the same bits as dequantize_head_i8(q, s, np.float16))."""
        n = self._qs(q, s)
        ck.check_array("out", out, np.float16, (n, self.dims.hidden), align=16)
        ck.launch(self._dequant, self._items_grid(n), THREADS, (q, s, out, np.int32(n)))

    def gemv_head_i8(self, q, s, x, out) -> None:
        """out_f32[N] = the int8 head . x, for one row: x fp16 [H] or [1, H], out fp32 [N] or [1, N]. Batches
        of 2 and more multiply the head's fp16 copy (dequantize_head_i8) through gemv_fp16 instead."""
        n = self._qs(q, s)
        h = self.dims.hidden
        ck.check_array("x", x, np.float16, align=16)
        b = ck.batch_rows("x", x, h)
        if b != 1:
            raise KernelError(f"gemv_head_i8 takes one row (batch 1), got x of {b} rows")
        ck.check_array("out", out, np.float32, (n,) if x.ndim == 1 else (1, n))
        units = (n + 1) // 2
        grid = ck.even_grid(self._gemv, -(-units // WARPS), THREADS)
        ck.launch(self._gemv, grid, THREADS, (q, s, x, out, np.int32(n)))
