"""Launchers for the decode GEMVs (cuda/gemv_int4.cu, cuda/gemv_fp16.cu): INT4 x FP16 with its fused
variants, and the FP16 lm_head. Shapes follow docs/INTERFACES.md section 4."""

from __future__ import annotations

import numpy as np

from . import checks as ck
from .dims import GROUP, HEAD_DIM, PAGE_TOKENS, ModelDims
from .errors import KernelError

INT4_SOURCES = ["gemv_int4.cu"]
FP16_SOURCES = ["gemv_fp16.cu"]
THREADS = 256
WARPS = THREADS // 32


# Builds of the INT4 GEMV (the -D knobs of gemv_int4.cu), as (small, large): "small" builds the K = H
# GEMV (o_proj) and the fused q/k/v, "large" the K = I GEMV (down_proj) and the fused gate/up.
#   default : half2 FMA dot products everywhere;
#   mma     : the dot products on tensor cores (gemv_int4_mma.cuh) everywhere;
#   mmaoff  : mma with the 1032 offset folded into a per-group sum of x;
#   mixed   : each matrix on the build measured fastest for it. H200, 2026-11-30 (bench_gemv.py --sweep,
#             docs/PERF.md): default/mma us: o 4.91/5.71, qkv 7.39/7.86, gate_up 25.56/24.60,
#             down 16.53/14.81. The tensor cores pay off where K or N is long enough to hide their
#             per-tile fixed cost (16-row tiles, a shared-memory reduction across the 8 warps).
# KernelSet picks one (argument, or $NANOQWEN_GEMV_VARIANT); all four pass the same GPU tests.
_MMA = {"NQ_GEMV_MMA": 1}
GEMV_VARIANTS: dict[str, tuple[dict[str, int], dict[str, int]]] = {
    "default": ({}, {}),
    "mma": (_MMA, _MMA),
    "mmaoff": ({**_MMA, "NQ_GEMV_MMA_OFFSET": 1}, {**_MMA, "NQ_GEMV_MMA_OFFSET": 1}),
    "mixed": ({}, _MMA),
}
DEFAULT_GEMV_VARIANT = "mixed"


class GemvKernels:
    def __init__(self, dims: ModelDims, load_module, tuning: dict[str, int] | None = None,
                 tuning_large: dict[str, int] | None = None):
        """tuning: extra -D knobs for the INT4 build (NQ_GEMV_STAGE_PIECES, NQ_GEMV_MMA; bench_gemv.py
        --sweep); tuning_large, when given, builds the K = I GEMV and gate/up separately with those."""
        self.dims = dims
        m = load_module(INT4_SOURCES, {**dims.defines(), **(tuning or {})})
        big = m if tuning_large is None else load_module(INT4_SOURCES, {**dims.defines(), **tuning_large})
        self._h = m.get_function("nq_gemv_int4_h")
        self._i = big.get_function("nq_gemv_int4_i")
        self._qkv = m.get_function("nq_qkv_rope_kv")
        self._gu = big.get_function("nq_gate_up_silu")
        self._fp16 = load_module(FP16_SOURCES, dims.defines()).get_function("nq_gemv_fp16")

    def _int4(self, qweight, scales, k: int | None = None) -> tuple[int, int]:
        """qweight uint32 [N, K/8], scales fp16 [N, K/128] with K one of the compiled (H, I)."""
        ck.check_array("qweight", qweight, np.uint32, align=16)
        ck.check_array("scales", scales, np.float16)
        if qweight.ndim != 2 or scales.ndim != 2:
            raise KernelError(f"qweight and scales must be 2-D, got {qweight.shape} and {scales.shape}")
        n, k8 = qweight.shape
        kk = k8 * 8
        if k is not None and kk != k:
            raise KernelError(f"qweight must be [N, {k // 8}] (K = {k}), got {tuple(qweight.shape)}")
        if kk not in (self.dims.hidden, self.dims.intermediate):
            raise KernelError(
                f"qweight K = {kk} is neither hidden {self.dims.hidden} nor intermediate "
                f"{self.dims.intermediate}: the GEMV is compiled for those two"
            )
        if tuple(scales.shape) != (n, kk // GROUP):
            raise KernelError(
                f"scales must be {(n, kk // GROUP)} for qweight {tuple(qweight.shape)}, "
                f"got {tuple(scales.shape)}"
            )
        if n < 1:
            raise KernelError("qweight has no rows")
        return n, kk

    def gemv_int4(self, qweight, scales, x, out, residual=None, norm_w=None, eps=1e-6) -> None:
        """out[N] = W . (norm(x) if norm_w else x) (+ residual[N]); residual may be out itself."""
        n, k = self._int4(qweight, scales)
        ck.check_array("x", x, np.float16, (k,), align=16)
        ck.check_array("out", out, np.float16, (n,))
        if residual is not None:
            ck.check_array("residual", residual, np.float16, (n,))
        if norm_w is not None:
            ck.check_array("norm_w", norm_w, np.float16, (k,), align=16)
        e = ck.check_eps(eps)
        ck.check_distinct(x=x, out=out)
        if residual is not None and residual.data.ptr != out.data.ptr:
            ck.check_distinct(residual=residual, out=out)
        fn = self._h if k == self.dims.hidden else self._i
        units = (n + 1) // 2
        grid = ck.even_grid(fn, -(-units // WARPS), THREADS)
        ck.launch(
            fn,
            grid,
            THREADS,
            (
                qweight,
                scales,
                x,
                norm_w if norm_w is not None else ck.NULL,
                e,
                residual if residual is not None else ck.NULL,
                out,
                np.int32(n),
            ),
        )

    def qkv_rope_kv(
        self, qweight, scales, bias, x, norm_w, eps, pos_dev, page_table, k_cache, v_cache, layer, q_out
    ) -> None:
        """Fused RMSNorm + q/k/v GEMV + bias + RoPE at pos_dev[0] + K/V into the page; q to q_out."""
        d = self.dims
        rows = d.qkv_rows
        n, _ = self._int4(qweight, scales, d.hidden)
        if n != rows:
            raise KernelError(f"qweight must have {rows} rows (q {d.q_dim} + k + v {d.kv_dim} each), got {n}")
        ck.check_array("bias", bias, np.float16, (rows,))
        ck.check_array("x", x, np.float16, (d.hidden,), align=16)
        ck.check_array("norm_w", norm_w, np.float16, (d.hidden,), align=16)
        e = ck.check_eps(eps)
        ck.check_array("pos_dev", pos_dev, np.int32, (1,))
        ck.check_array("page_table", page_table, np.int32)
        if page_table.ndim != 1 or page_table.size < 1:
            raise KernelError(f"page_table must be 1-D and non-empty, got shape {tuple(page_table.shape)}")
        ck.check_array("k_cache", k_cache, np.float16)
        ck.check_array("v_cache", v_cache, np.float16)
        want = (d.n_kv_heads, PAGE_TOKENS, HEAD_DIM)
        if k_cache.ndim != 5 or tuple(k_cache.shape[2:]) != want:
            raise KernelError(
                f"k_cache must be [n_layers, n_pages, {', '.join(map(str, want))}], "
                f"got {tuple(k_cache.shape)}"
            )
        if v_cache.shape != k_cache.shape:
            raise KernelError(
                f"v_cache shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}"
            )
        layer = ck.check_int("layer", layer, 0, k_cache.shape[0])
        ck.check_array("q_out", q_out, np.float16, (d.q_dim,))
        ck.check_distinct(x=x, q_out=q_out)
        grid = ck.even_grid(self._qkv, -(-(rows // 2) // WARPS), THREADS)
        ck.launch(
            self._qkv,
            grid,
            THREADS,
            (
                qweight,
                scales,
                bias,
                x,
                norm_w,
                e,
                pos_dev,
                page_table,
                k_cache,
                v_cache,
                np.int32(layer),
                np.int32(k_cache.shape[1]),
                q_out,
            ),
        )

    def gate_up_silu(self, qweight, scales, x, norm_w, eps, out) -> None:
        """Fused RMSNorm + gate/up GEMV (rows [0,I) gate, [I,2I) up) + silu(gate) * up into out[I]."""
        d = self.dims
        n, _ = self._int4(qweight, scales, d.hidden)
        if n != 2 * d.intermediate:
            raise KernelError(f"qweight must have 2 x intermediate = {2 * d.intermediate} rows, got {n}")
        ck.check_array("x", x, np.float16, (d.hidden,), align=16)
        if norm_w is not None:
            ck.check_array("norm_w", norm_w, np.float16, (d.hidden,), align=16)
        e = ck.check_eps(eps)
        ck.check_array("out", out, np.float16, (d.intermediate,))
        ck.check_distinct(x=x, out=out)
        grid = ck.even_grid(self._gu, -(-d.intermediate // WARPS), THREADS)
        ck.launch(
            self._gu, grid, THREADS, (qweight, scales, x, norm_w if norm_w is not None else ck.NULL, e, out)
        )

    def gemv_fp16(self, w, x, out) -> None:
        """out_f32[N] = w[N, H] . x[H] (the lm_head; fp32 logits)."""
        ck.check_array("w", w, np.float16, align=16)
        if w.ndim != 2 or w.shape[1] != self.dims.hidden or w.shape[0] < 1:
            raise KernelError(f"w must be [N, {self.dims.hidden}], got {tuple(w.shape)}")
        n = int(w.shape[0])
        ck.check_array("x", x, np.float16, (self.dims.hidden,), align=16)
        ck.check_array("out", out, np.float32, (n,))
        units = (n + 1) // 2
        grid = ck.even_grid(self._fp16, -(-units // WARPS), THREADS)
        ck.launch(self._fp16, grid, THREADS, (w, x, out, np.int32(n)))
