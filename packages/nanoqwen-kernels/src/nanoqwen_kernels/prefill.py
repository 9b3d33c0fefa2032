"""Prefill launchers: INT4 GEMM (fused on wgmma: gemm_int4_wg; or dequantize + cuBLAS, blas.py), RoPE + KV
page write, causal paged attention.

`PrefillKernels(dims, load_module)` exposes `gemm_int4_wg`, `dequantize_int4`, `gemm_int4`, `gemm_f16`,
`rope_kv_prefill` and `attention_prefill` (docs/INTERFACES.md section 4). All launch on the current CuPy stream and never
synchronise. T and start_pos are host ints: prefill runs eagerly, once per prompt, and its grid size
depends on T anyway (decode, captured in a graph, reads its position from the device instead).
"""

from __future__ import annotations

import os

import numpy as np

from . import checks as ck
from . import prefill_gemm as pg
from . import tma
from .blas import Blas
from .dims import GROUP, HEAD_DIM, PAGE_TOKENS, ModelDims
from .errors import KernelError
from .loader import extra_defines
from .prefill_fp8 import Fp8Kernels

PREFILL_SOURCES = ["gemm_int4_prefill.cu", "dequant_int4.cu", "prefill_rope_kv.cu", "attention_prefill_fma.cu", "attention_prefill.cu",
                   "prefill_act.cu"]
SILU_THREADS = 256  # prefill_act.cu: 8 outputs per thread
_DEQUANT_THREADS = 256
_DEQUANT_BLOCKS_PER_SM = 16  # grid-stride beyond this many blocks per SM: enough to fill each many times
# attention_prefill bodies: name -> (kernel, query rows per block, threads, dynamic smem bytes).
ATTENTION_VARIANTS = {
    "fma": ("nq_attention_prefill", 32, 256, 0),
    # attention_prefill.cu: 3 stages of K + V tiles (32 KB) + 1 KB to align them (nq_pre_wg::smem_bytes)
    "wg": ("nq_attention_prefill_wg", 64, 128, 3 * 32768 + 1024),
}
# "wg" (both products on wgmma, K/V read by the tensor cores from shared memory, two one-warpgroup blocks per
# SM) is the default: kernel time on the H200 (docs/PERF.md, "2026-12-01, tenth lease"; CUDA graph), 7B at
# T = 512 / 2k / 8k / 32k 14.7 us / 102 us / 1.13 ms / 18.3 ms (420-447 TFLOP/s at 32k), 1.5B dims 11.1 us /
# 55.7 us / 531 us / 6.89 ms (479 TFLOP/s). What it replaced, each measured slower at every length and
# removed: the mma.sync bodies "mma" / "mma_db" (7B 29.7 us / 229 us / 2.77 ms / 41.1 ms at 187 TFLOP/s),
# "mma2" and "wg_db" (S alone on wgmma), and "wg2" (one block of two warpgroups, 394 TFLOP/s at 32k). The
# tensor-core body rounds P to fp16 as FlashAttention does; its outputs differ from the fp32 reference by
# that rounding (<= 2^-11 sum p|v|, tests/test_attention_prefill.py). "fma" keeps fp32 probabilities:
# PrefillKernels(dims, load, "fma").
DEFAULT_ATTENTION_VARIANT = "wg"


def _check_positions(page_table, start_pos, t: int) -> int:
    """start_pos (an int >= 0) such that positions start_pos .. start_pos + t - 1 have pages."""
    start_pos = ck.check_int("start_pos", start_pos, 0)
    if start_pos + t > page_table.size * PAGE_TOKENS:
        raise KernelError(
            f"start_pos + T = {start_pos + t} exceeds the page table's {page_table.size * PAGE_TOKENS} positions"
        )
    return start_pos


def _check_pages(dims, k_cache, v_cache, layer, page_table, start_pos, t: int, ctl=None) -> tuple[int, int, int]:
    """The caches, the layer, the page table and the position range of T tokens written or read from
    start_pos: (layer, n_pages, start_pos). With ctl (device int32 [2] = start_pos, valid rows: a captured
    prefill graph's), start_pos must be None: the positions are the caller's to keep inside the table."""
    layer, n_pages = ck.check_kv_cache(dims, k_cache, v_cache, layer)
    ck.check_page_table(page_table)
    if ctl is None:
        return layer, n_pages, _check_positions(page_table, start_pos, t)
    ck.check_array("ctl", ctl, np.int32, shape=(2,))
    if start_pos is not None:
        raise KernelError("start_pos must be None when ctl (device start_pos, rows) is given")
    return layer, n_pages, 0


def _check_gemm_io(X, out, n: int, k: int) -> None:
    """The prefill GEMMs' activations X fp16 [T, K] and output out fp16 [T, N], not overlapping."""
    ck.check_array("X", X, np.float16)
    if X.ndim != 2 or X.shape[1] != k or X.shape[0] < 1:
        raise KernelError(f"X must be fp16 [T, {k}], got shape {tuple(X.shape)}")
    ck.check_array("out", out, np.float16, shape=(int(X.shape[0]), n))
    ck.check_distinct(X=X, out=out)


class PrefillKernels:
    """The prefill build for one ModelDims. `load_module(sources, defines)` is the loader's."""

    def __init__(self, dims: ModelDims, load_module, attention_variant: str | None = None):
        attention_variant = (attention_variant or os.environ.get("NANOQWEN_PREFILL_ATTENTION")
                             or DEFAULT_ATTENTION_VARIANT)
        if attention_variant not in ATTENTION_VARIANTS:
            raise KernelError(f"unknown attention_prefill variant {attention_variant!r}; one of "
                              f"{sorted(ATTENTION_VARIANTS)}")
        self.dims = dims
        self.attention_variant = attention_variant
        self._blas = Blas()
        mod = load_module(PREFILL_SOURCES, {**dims.defines(), "NQ_GW_STAGES": pg.GW_STAGES})
        # the ring's depth as built ($NANOQWEN_KERNEL_DEFINES may override it for an A/B run)
        self._gw_stages = extra_defines().get("NQ_GW_STAGES", pg.GW_STAGES)
        self._gw = {bn: mod.get_function(f"nq_gemm_int4_wg_n{bn}",
                                         max_dynamic_smem=pg.smem_bytes(bn, self._gw_stages))
                    for bn in pg.GW_WIDTHS}
        self._gw_silu = {bn: mod.get_function(f"nq_gemm_int4_wg_silu_n{bn}",
                                              max_dynamic_smem=pg.smem_bytes(bn, self._gw_stages))
                         for bn in pg.GW_WIDTHS}
        self._splitk_reduce = mod.get_function("nq_gemm_splitk_reduce")
        # the FP8 GEMM (opt-in prefill_weights="fp8"; its own module: prefill_fp8.py)
        self.fp8 = Fp8Kernels(dims, load_module, self._splitk)
        self.int4_to_e4m3, self.quantize_e4m3 = self.fp8.int4_to_e4m3, self.fp8.quantize_e4m3
        self.rmsnorm_e4m3 = self.fp8.rmsnorm_e4m3
        self.gemm_fp8, self.gemm_fp8_silu = self.fp8.gemm_fp8, self.fp8.gemm_fp8_silu
        self._x_maps: dict = {}
        kernel, rows, threads, smem = ATTENTION_VARIANTS[attention_variant]
        self._attn = (mod.get_function(kernel, max_dynamic_smem=smem), rows, threads, smem)
        self._dequant = mod.get_function("nq_dequantize_int4")
        self._rope = mod.get_function("nq_rope_kv_prefill")
        self._rope_vec = mod.get_function("nq_rope_kv_prefill_vec")
        # "vec" (4 pairs per thread, 256-thread blocks) unless $NANOQWEN_ROPE_PREFILL=scalar (A/B knob)
        self.rope_body = os.environ.get("NANOQWEN_ROPE_PREFILL", "vec")
        if self.rope_body not in ("vec", "scalar"):
            raise KernelError(f"NANOQWEN_ROPE_PREFILL must be vec or scalar, got {self.rope_body!r}")
        self._silu = mod.get_function("nq_silu_mul_rows")

    # ---- INT4 GEMM ------------------------------------------------------------------------------

    @staticmethod
    def _check_int4(qweight, scales) -> tuple[int, int]:
        ck.check_array("qweight", qweight, np.uint32)
        if qweight.ndim != 2 or qweight.shape[0] < 1 or qweight.shape[1] < 1:
            raise KernelError(f"qweight must be uint32 [N, K/8], got shape {tuple(qweight.shape)}")
        n, k = int(qweight.shape[0]), int(qweight.shape[1]) * 8
        if k % GROUP:
            raise KernelError(f"qweight K = {k} is not a multiple of the INT4 group {GROUP}")
        ck.check_array("scales", scales, np.float16, shape=(n, k // GROUP))
        return n, k

    def gemm_int4_wg(self, qweight, scales, X, out, accumulate: bool = False, tile: int | None = None,
                     splits: int | None = None, workspace=None) -> None:
        """out[T, N] fp16 = X[T, K] . W^T (+ out[T, N] when accumulate, in fp32 before the one rounding), W
        the INT4 weight (qweight uint32 [N, K/8] ValueShuffle-v1, scales fp16 [N, K/128]) read as stored and
        dequantized in registers into the tensor cores' operands (cuda/gemm_int4_prefill.cu): no fp16 copy
        of W. tile (tokens per block, prefill_gemm.GW_WIDTHS) and splits (split-K factor) default to
        prefill_gemm.choose_plan's for the shape. With splits > 1 the partial sums go to `workspace` (fp32,
        >= splits * T * N; from CuPy's pool when None) and a second launch adds them."""
        n, k, t = self._check_wg(qweight, scales, X, out)
        if n % 8:
            raise KernelError(f"gemm_int4_wg needs N % 8 == 0, got N = {n}")
        tile, s = pg.resolve_plan(t, n, k, ck.sm_count(), tile, splits)
        if s > 1:
            workspace = ck.workspace_f32(workspace, s * t * n)
        self._launch_gw(self._gw, tile, qweight, scales, X, out, t, n, k, accumulate,
                        workspace if s > 1 else ck.NULL, s)
        if s > 1:
            self._splitk(workspace, out, t, n, s, accumulate)

    def _splitk(self, workspace, out, t: int, n: int, splits: int, accumulate: bool) -> None:
        """out[T, N] fp16 = the sum of the `splits` fp32 partial sums in workspace (+ out): split-K's second
        launch, for the INT4 and the FP8 GEMMs alike."""
        quads = t * n // 4
        blocks = max(1, min(-(-quads // 256), 8 * ck.sm_count()))
        ck.launch(self._splitk_reduce, (blocks, 1, 1), (256, 1, 1),
                  (workspace, out, np.int32(t), np.int32(n), np.int32(splits), np.int32(1 if accumulate else 0)))

    def gemm_int4_wg_silu(self, qweight, scales, X, out, tile: int | None = None) -> None:
        """out[T, I] fp16 = silu(X . Wg^T) * (X . Wu^T): the MLP's gate|up GEMM (qweight uint32 [2I, K/8], gate
        rows then up rows, as gemm_int4_wg takes them) with SiLU(gate) * up in its epilogue, from the fp32
        sums (one rounding; the unfused path rounds gate and up to fp16 first). Replaces gemm_int4_wg into a
        [T, 2I] buffer + silu_mul: the 2I-wide output is never written. One split (the SiLU needs whole
        sums); tile as gemm_int4_wg's."""
        n, k, t = self._check_wg(qweight, scales, X, out, out_div=2)
        if n % 128:
            raise KernelError(f"gemm_int4_wg_silu needs 2I % 128 == 0, got {n} rows")
        if tile is None:
            tile = pg.choose_plan(t, n, k, ck.sm_count(), split_ok=False)[0]
        self._launch_gw(self._gw_silu, tile, qweight, scales, X, out, t, n, k, False, ck.NULL, 1)

    def _check_wg(self, qweight, scales, X, out, out_div: int = 1) -> tuple[int, int, int]:
        """(N, K, T) of a fused GEMM's arguments: the INT4 weight, X fp16 [T, K], out fp16 [T, N / out_div], X
        and out apart; the alignments its copies need (X, the words and out 16 bytes, the scale pairs 4)."""
        n, k = self._check_int4(qweight, scales)
        _check_gemm_io(X, out, n // out_div, k)
        for name, a in (("qweight", qweight), ("X", X), ("out", out)):
            ck.check_array(name, a, a.dtype, align=16)
        ck.check_array("scales", scales, np.float16, align=4)
        return n, k, int(X.shape[0])

    def _launch_gw(self, fns: dict, tile, qweight, scales, X, out, t: int, n: int, k: int, accumulate: bool, ws,
                   splits: int) -> None:
        """One launch of a fused-GEMM build (fns: its entry per tile width)."""
        if tile not in fns:
            raise KernelError(f"tile must be one of {pg.GW_WIDTHS}, got {tile!r}")
        ck.launch(fns[tile], pg.grid(t, n, tile, splits), (pg.GW_THREADS, 1, 1),
                  (self._x_map(X, t, k, tile), qweight, scales, out, np.int32(t), np.int32(n), np.int32(k),
                   np.int32(1 if accumulate else 0), ws, np.int32(splits)),
                  shared_mem=pg.smem_bytes(tile, self._gw_stages))

    def _x_map(self, X, t: int, k: int, bn: int):
        """X's TMA map (boxes of bn tokens x 64 k), encoded once per (address, shape, width): a prefill pass
        reuses the same activation buffers layer after layer."""
        key = (int(X.data.ptr), t, k, bn)
        m = self._x_maps.get(key)
        if m is None:
            if len(self._x_maps) >= 256:
                self._x_maps.clear()
            m = self._x_maps[key] = tma.encode_rows_f16(key[0], t, k, bn)
        return m

    def dequantize_int4(self, qweight, scales, out) -> None:
        """out[N, K] fp16 = scales[n, k/128] * (u - 8): qweight uint32 [N, K/8] (ValueShuffle-v1)."""
        n, k = self._check_int4(qweight, scales)
        ck.check_array("out", out, np.float16, shape=(n, k))
        words = n * k // 8
        per_block = _DEQUANT_THREADS * 4  # kWordsPerThread = 4 in dequant_int4.cu
        blocks = min(_DEQUANT_BLOCKS_PER_SM * ck.sm_count(), (words + per_block - 1) // per_block)
        ck.launch(
            self._dequant,
            (blocks, 1, 1),
            (_DEQUANT_THREADS, 1, 1),
            (qweight, scales, out, np.int32(n), np.int32(k)),
        )

    def gemm_int4(self, qweight, scales, X, out, workspace=None, accumulate: bool = False) -> None:
        """out[T, N] fp16 = X[T, K] . W^T (+ out[T, N] when accumulate: the residual add folded into the
        GEMM's beta = 1), W the INT4 weight dequantized to fp16, fp32 sums.

        Dequantize into `workspace` (fp16, >= N*K elements; allocated from CuPy's pool when None), then one
        cuBLAS GEMM on tensor cores (blas.py: a direct cublasGemmEx, ~5 us of Python per call where
        cupy.matmul took ~20, and no separate `out += ...` kernel for the residual).
        """
        cupy = ck.cupy_module()
        n, k = self._check_int4(qweight, scales)
        _check_gemm_io(X, out, n, k)
        if workspace is None:
            workspace = cupy.empty(n * k, dtype=np.float16)
        ck.check_array("workspace", workspace, np.float16, min_size=n * k)
        w = workspace[: n * k].reshape(n, k)
        self.dequantize_int4(qweight, scales, w)
        self._blas.gemm_nt(X, w, out, accumulate=accumulate)

    def gemm_f16(self, w, X, out, accumulate: bool = False) -> None:
        """out[T, N] fp16 = X[T, K] . w^T (+ out when accumulate), w an fp16 [N, K] weight kept dense on the
        device (the engine's resident copy of a dequantized INT4 matrix: gemm_int4 without its per-call
        dequantization); fp32 sums on tensor cores (cuBLAS)."""
        ck.check_array("w", w, np.float16)
        if w.ndim != 2 or w.shape[0] < 1 or w.shape[1] < 1:
            raise KernelError(f"w must be fp16 [N, K], got shape {tuple(w.shape)}")
        _check_gemm_io(X, out, int(w.shape[0]), int(w.shape[1]))
        self._blas.gemm_nt(X, w, out, accumulate=accumulate)

    def silu_mul(self, gu, out) -> None:
        """out[T, I] = silu(gu[:, :I]) * gu[:, I:] (fp32 inside, one rounding): the MLP activation of
        prefill, on the gate|up GEMM's output gu fp16 [T, 2I]."""
        i = self.dims.intermediate
        ck.check_array("gu", gu, np.float16, align=16)
        if gu.ndim != 2 or gu.shape[1] != 2 * i or gu.shape[0] < 1:
            raise KernelError(f"gu must be fp16 [T, {2 * i}], got shape {tuple(gu.shape)}")
        t = int(gu.shape[0])
        if t > 65535:
            raise KernelError(f"gu has {t} rows; a launch takes at most 65535 (grid.y)")
        ck.check_array("out", out, np.float16, shape=(t, i), align=16)
        ck.check_distinct(gu=gu, out=out)
        ck.launch(self._silu, (-(-i // (8 * SILU_THREADS)), t, 1), (SILU_THREADS, 1, 1), (gu, out))

    # ---- RoPE + KV page write ---------------------------------------------------------------------

    def rope_kv_prefill(self, qkv, start_pos, page_table, k_cache, v_cache, layer, q_out, bias=None,
                        ctl=None) -> None:
        """RoPE on q and k of T tokens at positions start_pos.., K/V into the pages, q into q_out; the
        projection's bias (fp16 [(n_heads + 2*n_kv)*128], optional) is added first, in fp32.

        qkv: fp16 [T, (n_heads + 2*n_kv)*128]; q_out: fp16 [T, n_heads*128];
        page_table int32 [max_pages] must cover positions < start_pos + T.
        ctl: None, or device int32 [2] = (start_pos, valid rows) read on the device (start_pos then None):
        a captured prefill graph's bucket of T rows, rows past ctl[1] padding (their K/V not written).
        """
        d = self.dims
        ck.check_array("qkv", qkv, np.float16)
        if qkv.ndim != 2 or qkv.shape[1] != d.qkv_rows or qkv.shape[0] < 1:
            raise KernelError(f"qkv must be fp16 [T, {d.qkv_rows}], got shape {tuple(qkv.shape)}")
        t = int(qkv.shape[0])
        ck.check_array("q_out", q_out, np.float16, shape=(t, d.q_dim))
        if bias is not None:
            ck.check_array("bias", bias, np.float16, shape=(d.qkv_rows,))
        layer, n_pages, start_pos = _check_pages(d, k_cache, v_cache, layer, page_table, start_pos, t, ctl)
        args = (
            qkv,
            bias if bias is not None else ck.NULL,
            np.int32(start_pos),
            ctl if ctl is not None else ck.NULL,
            page_table,
            k_cache,
            v_cache,
            np.int32(layer),
            np.int32(n_pages),
            q_out,
        )
        # the vec body reads 8-byte pieces: a bias view off an 8-byte boundary takes the scalar one
        if self.rope_body == "vec" and (bias is None or bias.data.ptr % 8 == 0):
            items = t * (d.n_heads + 2 * d.n_kv_heads) * (HEAD_DIM // 8)
            ck.launch(self._rope_vec, (-(-items // 256), 1, 1), (256, 1, 1), (*args, np.int32(t)))
        else:
            ck.launch(self._rope, (t, d.n_heads + 2 * d.n_kv_heads, 1), (HEAD_DIM // 2, 1, 1), args)

    # ---- causal attention over the pages ----------------------------------------------------------

    def attention_prefill(self, q, k_cache, v_cache, page_table, start_pos, T, layer, out, ctl=None) -> None:
        """out[i, h] = causal attention of query i (position start_pos + i) over positions <= it.

        q, out: fp16 [T, n_heads*128] (q roped); K/V for positions < start_pos + T in the pages.
        ctl: None, or device int32 [2] = (start_pos, T) read on the device (start_pos then None; the launch
        covers all T rows of q, rows past ctl[1] neither read nor written).
        """
        d = self.dims
        T = ck.check_int("T", T, 1)
        ck.check_array("q", q, np.float16)
        if q.ndim == 2 and q.shape[0] != T:
            raise KernelError(f"q has {q.shape[0]} rows but T = {T}")
        ck.check_array("q", q, np.float16, shape=(T, d.q_dim))
        ck.check_array("out", out, np.float16, shape=(T, d.q_dim))
        layer, n_pages, start_pos = _check_pages(d, k_cache, v_cache, layer, page_table, start_pos, T, ctl)
        fn, rows, threads, smem = self._attn
        ck.launch(
            fn,
            ((T + rows - 1) // rows, d.n_heads, 1),
            (threads, 1, 1),
            (
                q,
                k_cache,
                v_cache,
                page_table,
                np.int32(start_pos),
                np.int32(T),
                ctl if ctl is not None else ck.NULL,
                np.int32(layer),
                np.int32(n_pages),
                out,
            ),
            shared_mem=smem,
        )
