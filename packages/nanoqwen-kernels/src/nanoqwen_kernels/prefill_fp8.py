"""The FP8 prefill GEMM's launchers and its numpy twins (opt-in: the engine's prefill_weights="fp8").

    int4_to_e4m3(qweight, scales, rowmap)  -> (w8 uint8 [N, K] e4m3 of q = u - 8, sw float32 [G, n_pad])
    quantize_e4m3(X, xq, sx)               X fp16 [T, K] -> xq uint8 [T, K], sx float32 [>= T] (a scale per token)
    rmsnorm_e4m3(x, w, xq, sx, eps)        rmsnorm_rows(x, w) then quantize_e4m3, in one pass (same bits)
    gemm_fp8(w8, sw, xq, sx, out, ...)     out[T, N] fp16 = sx[t] sum over groups of (xq . w8^T) sw (+ out)
    gemm_fp8_silu(...)                     the gate|up GEMM with silu(gate) * up in its epilogue

What is rounded and why (cuda/gemm_fp8_prefill.cu has the whole story): the INT4 integers are exact in
e4m3, the group scales stay fp32 and multiply each group's partial sum, so the weights are the same numbers
as on every other path; the activations are rounded to e4m3 with a scale per token row. That rounding is a
numerics change (scripts/fp8_prefill_numerics.py measures it on a real model), which is why
this path is opt-in.

The numpy twins (round_e4m3, e4m3_to_f32, quantize_rows_np, gemm_fp8_np) are the tests' references and the
host stand-in's math (nanoqwen_engine.cuda.host_kernels).
"""

from __future__ import annotations

import numpy as np

from . import checks as ck
from . import prefill_gemm as pg
from . import tma
from .dims import GROUP
from .errors import KernelError

FP8_SOURCES = ["gemm_fp8_prefill.cu", "prefill_quant.cu"]
E4M3_MAX = 448.0
N_ALIGN = 128  # sw's columns: whole 128-row tiles (a tile copies its rows' scales whole)
QUANT_THREADS = 256
CONVERT_THREADS = 256


def n_pad(n: int) -> int:
    """Columns of sw for N weight rows: N rounded up to N_ALIGN."""
    return -(-n // N_ALIGN) * N_ALIGN


# ---- numpy: e4m3 ---------------------------------------------------------------------------------------


def round_e4m3(y: np.ndarray) -> np.ndarray:
    """float32 -> the nearest e4m3 value as float32 (ties to even, saturating at +-448): 3 mantissa bits,
    exponents -6 .. 8, subnormals in steps of 2^-9 (what PTX's cvt.rn.satfinite.e4m3x2.f32 computes)."""
    y = np.asarray(y, dtype=np.float32)
    a = np.abs(y)
    _, ex = np.frexp(a)  # a = m 2^ex, m in [0.5, 1): the binade's exponent is ex - 1
    e = np.maximum(ex.astype(np.int32) - 1, -6)
    step = np.ldexp(np.float32(1.0), e - 3).astype(np.float32)
    r = np.minimum(np.rint(a / step) * step, np.float32(E4M3_MAX))
    return np.copysign(r, y).astype(np.float32)


def e4m3_bytes(v: np.ndarray) -> np.ndarray:
    """Exactly representable e4m3 values (float32) -> their bytes (uint8)."""
    v = np.asarray(v, dtype=np.float32)
    a = np.abs(v)
    _, ex = np.frexp(a)
    e = ex.astype(np.int32) - 1
    normal = a >= 2.0**-6
    exp_bits = np.where(normal, e + 7, 0)
    mant = np.where(normal, a / np.ldexp(np.float32(1.0), e) - 1.0, a / 2.0**-9 / 8.0) * 8.0
    b = (exp_bits << 3) | np.rint(mant).astype(np.int32)
    b = np.where(a == 0, 0, b) | (np.signbit(v).astype(np.int32) << 7)
    return b.astype(np.uint8)


def e4m3_to_f32(b: np.ndarray) -> np.ndarray:
    """e4m3 bytes (uint8) -> float32 (no NaN handling: the kernels saturate, never write 0x7F / 0xFF)."""
    b = np.asarray(b, dtype=np.uint8).astype(np.int32)
    exp_bits, mant = (b >> 3) & 15, (b & 7).astype(np.float32)
    mag = np.where(exp_bits == 0, mant / 8.0 * 2.0**-6, (1.0 + mant / 8.0) * np.ldexp(1.0, exp_bits - 7))
    return np.where(b & 0x80, -mag, mag).astype(np.float32)


E4M3_OF_U = e4m3_bytes(np.arange(16, dtype=np.float32) - 8)  # byte of q = u - 8 for nibble u (the kernel's kLut)


def silu_rowmap(n: int) -> np.ndarray:
    """For the gate|up matrix (gate rows 0 .. I - 1, up rows I .. 2I - 1, n = 2I): the source row of each row
    of its FP8 copy, interleaved as the SiLU build's tiles want them (gemm_int4_prefill.cu's tile_row<true>:
    in the 128 rows of tile y, row r is the gate (r / 8 even) or the up (odd) row of output
    64 y + 8 (r / 16) + r % 8), so a tile of the copy is a plain 128-row box."""
    if n % pg.GW_ROWS:
        raise KernelError(f"the SiLU build needs 2I % 128 == 0, got {n} rows")
    i = n // 2
    r = np.arange(n)
    y, rr = r // pg.GW_ROWS, r % pg.GW_ROWS
    a = 64 * y + 8 * (rr >> 4) + (rr & 7)
    return np.where((rr >> 3) & 1, i + a, a).astype(np.int32)


def quantize_rows_np(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What nq_quantize_e4m3_rows computes: x fp16 [T, K] -> (xq uint8 [T, K], sx float32 [T])."""
    xf = np.asarray(x, dtype=np.float32)
    m = np.abs(xf).max(axis=1, keepdims=True)
    s = np.where(m > 0, m / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
    return e4m3_bytes(round_e4m3(xf / s)), s[:, 0].copy()


def gemm_fp8_np(w8: np.ndarray, sw: np.ndarray, xq: np.ndarray, sx: np.ndarray) -> np.ndarray:
    """The FP8 GEMM's sums in float64: out[t, n] = sx[t] sum_g (sum_k xq[t, k] w8[n, k]) sw[g, n]
    (w8 [N, K], sw [G, >= N], xq [T, K], sx [>= T]; bytes decoded as e4m3)."""
    w = e4m3_to_f32(w8).astype(np.float64)
    x = e4m3_to_f32(xq).astype(np.float64)
    n, k = w.shape
    t = x.shape[0]
    out = np.zeros((t, n))
    for g in range(k // GROUP):
        sl = slice(g * GROUP, (g + 1) * GROUP)
        out += (x[:, sl] @ w[:, sl].T) * sw[g, None, :n].astype(np.float64)
    return out * sx[:t, None].astype(np.float64)


# ---- the launchers --------------------------------------------------------------------------------------


class Fp8Kernels:
    """The FP8 build for one ModelDims: `load_module(sources, defines)` is the loader's, `splitk_reduce` the
    fused INT4 GEMM's second launch (gemm_int4_prefill.cu's nq_gemm_splitk_reduce), which adds split-K
    partial sums for both GEMMs."""

    def __init__(self, dims, load_module, splitk_reduce):
        mod = load_module(FP8_SOURCES, dims.defines())

        def entries(prefix: str, silu: bool) -> dict:
            """per width: (the entry, its launches' dynamic shared memory; the SiLU build's staging is half
            as wide)"""
            smem = {bn: pg.fp8_smem_bytes(bn, silu) for bn in pg.GF8_WIDTHS}
            return {bn: (mod.get_function(f"{prefix}_n{bn}", max_dynamic_smem=smem[bn]), smem[bn])
                    for bn in pg.GF8_WIDTHS}

        self._gf = entries("nq_gemm_fp8_wg", False)
        self._gf_silu = entries("nq_gemm_fp8_wg_silu", True)
        # the row in dynamic shared memory: K x 2 bytes (above 48 KB needs the opt-in, up to 227 KB: K <= 116k)
        self._quant = mod.get_function("nq_quantize_e4m3_rows",
                                       max_dynamic_smem=2 * max(dims.hidden, dims.q_dim, dims.intermediate))
        self._convert = mod.get_function("nq_int4_to_e4m3")
        self._norm = mod.get_function("nq_rmsnorm_e4m3_rows")
        self.dims = dims
        self._splitk_reduce = splitk_reduce
        self._maps: dict = {}

    def int4_to_e4m3(self, qweight, scales, rowmap=None):
        """The resident FP8 copy of an INT4 matrix (qweight uint32 [N, K/8] ValueShuffle-v1, scales fp16
        [N, K/128]): (w8 uint8 [N, K], row r = e4m3 of row rowmap[r]'s integers; sw float32 [G, n_pad(N)], the
        same rows' scales by group, zero past N). rowmap None: the identity."""
        cp = ck.cupy_module()
        ck.check_array("qweight", qweight, np.uint32)
        if qweight.ndim != 2:
            raise KernelError(f"qweight must be uint32 [N, K/8], got shape {tuple(qweight.shape)}")
        n, k = int(qweight.shape[0]), int(qweight.shape[1]) * 8
        if k % GROUP:
            raise KernelError(f"qweight K = {k} is not a multiple of the INT4 group {GROUP}")
        ck.check_array("scales", scales, np.float16, shape=(n, k // GROUP))
        rows = np.arange(n, dtype=np.int32) if rowmap is None else np.asarray(rowmap, dtype=np.int32)
        if rows.shape != (n,) or rows.min() < 0 or rows.max() >= n:
            raise KernelError(f"rowmap must be int32 [{n}] of rows 0 .. {n - 1}")
        rows_d = cp.asarray(rows)
        w8 = cp.empty((n, k), dtype=np.uint8)
        words = n * k // 8
        ck.launch(self._convert, (-(-words // CONVERT_THREADS), 1, 1), (CONVERT_THREADS, 1, 1),
                  (qweight, rows_d, w8, np.int32(n), np.int32(k)))
        sw = cp.zeros((k // GROUP, n_pad(n)), dtype=np.float32)
        sw[:, :n] = scales[rows_d].astype(np.float32).T
        return w8, sw

    def quantize_e4m3(self, X, xq, sx) -> None:
        """X fp16 [T, K] -> xq uint8 [T, K] (e4m3 of X / its row's scale) and sx float32 [>= T] (a scale per
        token row: amax / 448, 1 for an all-zero row)."""
        ck.check_array("X", X, np.float16, align=8)
        if X.ndim != 2 or X.shape[0] < 1 or X.shape[1] % GROUP:
            raise KernelError(f"X must be fp16 [T, K] with K % {GROUP} == 0, got shape {tuple(X.shape)}")
        t, k = int(X.shape[0]), int(X.shape[1])
        if t > 2**31 - 1 or 2 * k > 227 * 1024:
            raise KernelError(f"X [{t}, {k}]: at most 2^31 - 1 rows of at most {227 * 512} values")
        ck.check_array("xq", xq, np.uint8, shape=(t, k), align=16)
        self._check_sx(sx, t)
        ck.check_distinct(X=X, xq=xq, sx=sx)
        ck.launch(self._quant, (t, 1, 1), (QUANT_THREADS, 1, 1), (X, xq, sx, np.int32(k)), shared_mem=2 * k)

    def rmsnorm_e4m3(self, x, w, xq, sx, eps) -> None:
        """quantize_e4m3 of rmsnorm_rows(x, w, eps) without the fp16 rows in between: x fp16 [T, H], w fp16
        [H], xq uint8 [T, H], sx float32 [>= T]; the same bits as the two launches."""
        h = self.dims.hidden
        ck.check_array("x", x, np.float16, align=16)
        if x.ndim != 2 or x.shape[1] != h or x.shape[0] < 1:
            raise KernelError(f"x must be fp16 [T, {h}], got shape {tuple(x.shape)}")
        t = int(x.shape[0])
        ck.check_array("w", w, np.float16, shape=(h,), align=16)
        ck.check_array("xq", xq, np.uint8, shape=(t, h), align=16)
        self._check_sx(sx, t)
        ck.launch(self._norm, (t, 1, 1), (QUANT_THREADS, 1, 1), (x, w, xq, sx, np.float32(eps)))

    def gemm_fp8(self, w8, sw, xq, sx, out, accumulate: bool = False, tile: int | None = None,
                 splits: int | None = None, workspace=None) -> None:
        """out[t, n] fp16 = sx[t] sum over K's groups g of sw[g, n] (xq[t, g] . w8[n, g]) (+ out when
        accumulate, in fp32 before the one rounding). tile (prefill_gemm.GF8_WIDTHS) and splits default to
        prefill_gemm.choose_plan_fp8's; with splits > 1 the fp32 partial sums go to `workspace` (>= splits T N)
        and a second launch adds them."""
        n, k, t = self._check(w8, sw, xq, sx, out, 1)
        if n % 8:
            raise KernelError(f"gemm_fp8 needs N % 8 == 0, got N = {n}")
        tile, s = pg.resolve_plan(t, n, k, ck.sm_count(), tile, splits, fp8=True)
        if s > 1:
            workspace = ck.workspace_f32(workspace, s * t * n)
        self._launch(self._gf, tile, w8, sw, xq, sx, out, t, n, k, accumulate, workspace if s > 1 else ck.NULL, s)
        if s > 1:
            self._splitk_reduce(workspace, out, t, n, s, accumulate)

    def gemm_fp8_silu(self, w8, sw, xq, sx, out, tile: int | None = None) -> None:
        """out[T, I] fp16 = silu(gate) * up from the fp32 sums of the gate|up matrix's FP8 copy made with
        rowmap = silu_rowmap(2I) (one split)."""
        n, k, t = self._check(w8, sw, xq, sx, out, 2)
        if n % pg.GW_ROWS:
            raise KernelError(f"gemm_fp8_silu needs 2I % 128 == 0, got {n} rows")
        if tile is None:
            tile = pg.choose_plan_fp8(t, n, k, ck.sm_count(), split_ok=False)[0]
        self._launch(self._gf_silu, tile, w8, sw, xq, sx, out, t, n, k, False, ck.NULL, 1)

    @staticmethod
    def _check_sx(sx, t: int) -> None:
        ck.check_array("sx", sx, np.float32)
        if sx.ndim != 1 or sx.shape[0] < t:
            raise KernelError(f"sx must be float32 [>= {t}] (a scale per token), got shape {tuple(sx.shape)}")

    def _check(self, w8, sw, xq, sx, out, out_div: int) -> tuple[int, int, int]:
        ck.check_array("w8", w8, np.uint8, align=16)
        if w8.ndim != 2 or w8.shape[0] < 1 or w8.shape[1] % GROUP or w8.shape[1] < GROUP:
            raise KernelError(f"w8 must be uint8 [N, K] with K % {GROUP} == 0, got shape {tuple(w8.shape)}")
        n, k = int(w8.shape[0]), int(w8.shape[1])
        ck.check_array("sw", sw, np.float32, shape=(k // GROUP, n_pad(n)), align=16)
        ck.check_array("xq", xq, np.uint8, align=16)
        if xq.ndim != 2 or xq.shape[1] != k or xq.shape[0] < 1:
            raise KernelError(f"xq must be uint8 [T, {k}], got shape {tuple(xq.shape)}")
        t = int(xq.shape[0])
        self._check_sx(sx, t)
        ck.check_array("out", out, np.float16, shape=(t, n // out_div), align=16)
        ck.check_distinct(xq=xq, out=out)
        return n, k, t

    def _launch(self, fns: dict, tile, w8, sw, xq, sx, out, t: int, n: int, k: int, accumulate: bool, ws,
                splits: int) -> None:
        if tile not in fns:
            raise KernelError(f"tile must be one of {pg.GF8_WIDTHS}, got {tile!r}")
        xmap = self._map(xq, t, k, tile)
        wmap = self._map(w8, n, k, pg.GW_ROWS)
        fn, smem = fns[tile]
        ck.launch(fn, pg.fp8_grid(t, n, tile, splits, ck.sm_count()), (pg.GF8_THREADS, 1, 1),
                  (xmap, wmap, sw, sx, out, np.int32(t), np.int32(n), np.int32(k), np.int32(sw.shape[1]),
                   np.int32(1 if accumulate else 0), ws, np.int32(splits), np.int32(pg.GF8_BAND)),
                  shared_mem=smem)

    def _map(self, a, rows: int, cols: int, box_rows: int):
        """A byte matrix's TMA map (boxes of box_rows x 128), once per (address, shape, box)."""
        key = (int(a.data.ptr), rows, cols, box_rows)
        m = self._maps.get(key)
        if m is None:
            if len(self._maps) >= 1024:
                self._maps.clear()
            m = self._maps[key] = tma.encode_rows_u8(key[0], rows, cols, box_rows)
        return m
