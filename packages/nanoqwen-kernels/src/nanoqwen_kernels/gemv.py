"""Launchers for the decode GEMVs (cuda/gemv_int4.cu, cuda/gemv_fp16.cu, their tensor-core core
cuda/gemv_mma.cuh): INT4 x FP16 with its fused variants, and the FP16 lm_head, for B sequences at once.
Shapes follow docs/INTERFACES.md section 4: x is [B, K] (a 1-D x is B = 1, outputs then 1-D too), and B
is x.shape[0]; positions and page tables are read from device memory, so a captured CUDA graph per batch
size serves every step.

Which body runs:
  B = 1   the half2 loop or the tensor-core core, per matrix, as the GEMV variant says (below);
  B > 1   the INT4 GEMVs on the tile GEMM (gemm_tiles.cuh, planned by `plan_tiles`) in the "tiles"
          variants, but o_proj at B <= 8 (TILE_CORE_KINDS); else on the tensor-core core: up to 32
          columns (sequences) per pass over the weights, planned by `plan_gemv` (passes, and the slices
          of K that x is staged in). The lm_head
          (gemv_fp16) at B > 1 is one cuBLAS GEMM (blas.py; LM_HEAD_BODIES), or gemv_mma's passes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from . import checks as ck
from .a8 import A8_BLOCK
from .blas import Blas
from .dims import GROUP, ModelDims
from .errors import KernelError
from .gemv_b1 import (
    THREADS,
    WARPS,
    b1_a8_image_pair,
    b1_build_defines,
    b1_clusters,
    b1_short_defines,
    b1_split,
)
from .tile_plan import (
    TILE_BUILDS,
    TILE_UNITS,
    plan_tiles,
    tile_min_items,
    tile_smem,
    tile_threads,
    tile_x_preperm,
)

INT4_SOURCES = ["gemv_int4.cu"]
FP16_SOURCES = ["gemv_fp16.cu"]
TILE_ROWS = 16  # rows per tile of the tensor-core core (8 units of 2 rows)
MMA_BUILDS = (8, 32)  # columns per pass each tensor-core entry is built for (suffix _mma8, _mma32)
X_PAD = 16  # halves of padding per staged x row (gemv_mma.cuh kXPad)
X_SMEM_BUDGET = 200 * 1024  # dynamic shared memory for staged x; + <= 18.5 KB static stays under 227 KB
# With few tiles (about one per block) a block restages x per tile anyway: x then goes in slices small
# enough for two blocks per SM (the builds are register-bounded for two), so one block's staging overlaps
# the other's multiply
X_SMEM_FEW_TILES = 90 * 1024

# The GEMV variant: which matrices run on the tensor-core core at B = 1 (B > 1 always does).
#   "h" o_proj (K = H), "i" down_proj (K = I), "qkv" the fused q/k/v, "gu" the fused gate/up.
#   default : the half2 loop everywhere (the default: the fastest at B = 1 as measured);
#   mma     : the tensor-core core everywhere (B = 1 then gives the same bits as a row of any batch);
# H200, 2026-11-30, commit 04608fd (bench_gemv.py --batch 1 --sweep, docs/PERF.md), us at B = 1,
# half2 loop / tensor-core core: o_proj 5.02 / 7.19, q/k/v 7.38 / 12.68, gate/up 25.61 / 41.05,
# down 15.35 / 21.51. The core is built for batches (x of up to 32 sequences in shared memory, two
# batches of loads in flight per warp); at B = 1 it keeps too few bytes in flight (docs/PERF.md).
# KernelSet picks one (argument, or $NANOQWEN_GEMV_VARIANT); all pass the same GPU tests.
#   tiles   : B = 1 as "default"; B > 1 on the tile GEMM (gemm_tiles.cuh, planned by `plan_tiles`).
#   a8      : B = 1 on the int8-activation loop (gemv_int4.cu "_a8" entries: x rounded to int8 per 16 k,
#             products by dp4a; ~4 instructions per 8 weights against the half2 loop's ~19), B > 1 as
#             "tiles". It changes the numbers (the activation's rounding, as llama.cpp's q8_1 GEMVs do),
#             so a KernelSet builds it only when asked (A8_VARIANTS says which variants do it); the
#             engine asks by default (decode_activations="int8", nanoqwen_engine.cuda.load).
# Removed after measuring: "packed" / "packed1", the tile GEMM reading a tile-major copy of each matrix
# at B <= 16 (twice the INT4 weight memory). H200, 2026-11-30, commit 226e4e9, bench_gemv.py 7B, us per
# layer of the four INT4 GEMVs, tiles / packed1: B = 8 96.3 / 93.3, B = 16 108.1 / 114.5, B = 32
# 151.2 / 151.3 and B = 64 252.0 / 254.6 (the same row-by-row entries: noise); B = 1 195.7 (eager-timed:
# the copy's first launch cannot be captured) vs tiles1 90.8 and the half2 loop 54.5.
# Removed as measured slower everywhere (issue 15: fewer variants, fewer paths to test): "tiles1", every B
# on the tile GEMM (B = 1: 90.8 against the half2 loop's 54.5 us per layer above; B > 1 = "tiles"), and
# "mixed", down and gate/up on the tensor-core core at B = 1 (gate/up 41.05 / down 21.51 us against the
# half2 loop's 25.61 / 15.35 above; B > 1 = "default", the core's passes, slower than the tile GEMM).
GEMV_KINDS = ("h", "i", "qkv", "gu")
GEMV_VARIANTS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "mma": frozenset(GEMV_KINDS),
    "tiles": frozenset(),
    "a8": frozenset(),
}
A8_VARIANTS = frozenset({"a8"})  # B = 1 on the int8-activation loop (instead of the half2 loop)
TILE_VARIANTS = frozenset({"tiles", "a8"})  # B > 1 on the tile GEMM
DEFAULT_GEMV_VARIANT = "tiles"  # B = 1 on the half2 loop, B > 1 on the tile GEMM (docs/PERF.md)

# The lm_head (gemv_fp16) at B > 1; B = 1 is always the fp16 half2 GEMV (99% of the copy bandwidth).
#   blas : one cuBLAS GEMM, fp16 in, fp32 sums and logits (blas.py): W read once at any B;
#   mma  : gemv_mma's passes: x of up to ~28 sequences staged per pass, so B = 32 reads the 1.09 GB
#          (7B) twice and B = 64 three times (0.97 ms of a 5.97 ms step at B = 32, c89cb93).
# KernelSet picks one (argument, or $NANOQWEN_LM_HEAD).
LM_HEAD_BODIES = ("blas", "mma")
DEFAULT_LM_HEAD = "blas"


A8_IMAGE_GROUPS = 8  # groups of 32 outputs a block of nq_gate_up_silu_a8x takes at most (kA8ImageGroups)


@dataclass(frozen=True)
class GemvPlan:
    """How the tensor-core core covers B columns of one GEMV."""

    build: int  # the entry: 8 or 32 columns per pass at most (MMA_BUILDS)
    pass_cols: int  # columns per pass (the last pass may have fewer)
    passes: int  # grid.y; each pass reads the weights once
    slice_groups: int  # 128-k groups of x staged at a time (all of K: staged once per block)
    smem: int  # dynamic shared memory bytes


def _x_bytes(cols: int, slice_groups: int) -> int:
    return cols * (slice_groups * GROUP + X_PAD) * 2


def plan_gemv(b: int, k: int, n_tiles: int, sm_count: int) -> GemvPlan:
    """Passes and x slices for B columns of a K-long GEMV of n_tiles 16-row tiles.

    x of a pass lives in shared memory. When all of K fits for the pass's columns, a block stages it once
    and runs all its tiles over it. When it does not, either each tile restages x slice by slice (cheap
    when there are few tiles, about one per block anyway: down_proj and o_proj), or the columns are split
    over more passes so that K fits (many tiles: gate/up, lm_head), each pass reading the weights again
    (from L2, mostly: the passes' blocks run side by side over the same tiles).
    """
    groups = k // GROUP
    few = n_tiles <= 2 * sm_count
    budget = X_SMEM_FEW_TILES if few else X_SMEM_BUDGET
    want = min(b, MMA_BUILDS[-1])
    passes = -(-b // want)
    if not few and _x_bytes(want, groups) > budget:
        cap = max(1, budget // _x_bytes(1, groups))
        passes = -(-b // min(cap, want))
    pass_cols = -(-b // passes)
    if _x_bytes(pass_cols, groups) <= budget:
        slice_groups = groups
    else:  # a multiple of 8 groups (the warp of a group stays g % 8: the same sums as unsliced)
        fit = (budget // (2 * pass_cols) - X_PAD) // GROUP
        slice_groups = max(8, fit // 8 * 8)
    build = next(c for c in MMA_BUILDS if c >= pass_cols)
    return GemvPlan(build, pass_cols, passes, slice_groups, _x_bytes(pass_cols, slice_groups))


# ---- which matrices run on the tile GEMM at B > 1 (its plan and launch shape: tile_plan.py) -------------
# o_proj at B <= 8 runs on the tensor-core core rather than the tile GEMM: a 3584 x 3584 matrix is 98 tile
# blocks of 2 work items each, whose fixed costs (ring fill, partial sums, the last block's reduction) the
# core does not pay. H200, ce87abe, bench_batch (7B, 128 + 256 tokens) step at B = 8, two runs each: tile
# GEMM 2.72 / 2.73 ms, o_proj on the core 2.64 / 2.66 ms, o_proj and q/k/v on the core 2.81 ms; B = 16
# unchanged. The price: a sequence's o_proj bits differ between B <= 8 and B > 8 (as B = 1's half2 loop
# differs from both): greedy outputs may part at a near-tie when a batch grows past 8.
TILE_CORE_MAX_B = 8  # the largest B that tile_core_kinds() sends to the tensor-core core
TILE_CORE_KINDS = "h"


def tile_core_kinds() -> frozenset[str]:
    """Matrix kinds (GEMV_KINDS) run on the tensor-core core instead of the tile GEMM at B <=
    TILE_CORE_MAX_B: TILE_CORE_KINDS, or $NANOQWEN_TILE_CORE_KINDS (comma-separated; empty: none)."""
    raw = os.environ.get("NANOQWEN_TILE_CORE_KINDS", TILE_CORE_KINDS)
    kinds = frozenset(k.strip() for k in raw.split(",") if k.strip())
    if not kinds <= set(GEMV_KINDS):
        raise KernelError(f"NANOQWEN_TILE_CORE_KINDS={raw!r}: expected kinds among {', '.join(GEMV_KINDS)}")
    return kinds


class GemvKernels:
    def __init__(self, dims: ModelDims, load_module, variant: str = DEFAULT_GEMV_VARIANT,
                 lm_head: str = DEFAULT_LM_HEAD, short_context: bool = False):
        """variant: a key of GEMV_VARIANTS (the body each matrix runs on at B = 1); lm_head: one of
        LM_HEAD_BODIES (the lm_head's body at B > 1); short_context: the short-context build (b1_short_defines
        over the int8 loop's build), which differs from the default build only in its B = 1 loop, so it serves
        B = 1 alone (no tile GEMM state of its own; a batch is one KernelError)."""
        if variant not in GEMV_VARIANTS:
            raise KernelError(f"unknown INT4 GEMV variant {variant!r}; one of {', '.join(GEMV_VARIANTS)}")
        if lm_head not in LM_HEAD_BODIES:
            raise KernelError(f"unknown lm_head body {lm_head!r}; one of {', '.join(LM_HEAD_BODIES)}")
        self.dims = dims
        self.variant = variant
        self.lm_head = lm_head
        self._blas = Blas()
        self._mma_at_b1 = GEMV_VARIANTS[variant]
        self._b1_only = short_context
        self._a8 = variant in A8_VARIANTS
        # the int8 loop's split units (b1_build_defines), in its build; the grid of each kind's B = 1 loop
        # follows the build (never $NANOQWEN_KERNEL_DEFINES at a launch)
        sms = ck.sm_count()
        split_defs = {**b1_build_defines(dims, sms), **(b1_short_defines(dims, sms) if short_context else {})
                      } if self._a8 else {}
        # gate/up -> down_proj at B = 1 as the a8 image pair (b1_a8_image_pair); the step asks this
        self.a8_image_pair = self._a8 and b1_a8_image_pair(dims, sms)
        self._split = {kind: (b1_split(kind, split_defs) if self._a8 else 1) for kind in GEMV_KINDS}
        # each kind's prologue shared by a thread-block cluster of this many blocks (gemv_a8_cluster.cuh; the build's
        # NQ_DOWN_CLUSTER, NQ_QKV_CLUSTER, NQ_O_CLUSTER, NQ_GU_CLUSTER, b1_build_defines, or $NANOQWEN_KERNEL_DEFINES'
        # over it); a split down_proj never shares (the kernel's kCluster)
        clusters = b1_clusters(split_defs)
        self._cluster = {kind: (clusters[kind] if self._a8 else 1) for kind in GEMV_KINDS}
        if self._split["i"] > 1:
            self._cluster["i"] = 1
        m = load_module(INT4_SOURCES, {**dims.defines(), **split_defs})
        f = load_module(FP16_SOURCES, dims.defines())
        smem = X_SMEM_BUDGET
        names = {"h": "nq_gemv_int4_h", "i": "nq_gemv_int4_i", "qkv": "nq_qkv_rope_kv", "gu": "nq_gate_up_silu"}
        suffix = "_a8" if self._a8 else ""  # the B = 1 loop: half2, or int8 activations
        self._half2 = {kind: m.get_function(name + suffix) for kind, name in names.items()}
        # the a8 image pair: gate/up writing down_proj's x already rounded, and down_proj reading it
        self._gu_image = m.get_function("nq_gate_up_silu_a8x") if self._a8 else None
        self._down_image = m.get_function("nq_gemv_int4_i_a8x") if self._a8 else None
        self._mma = {
            (kind, c): m.get_function(f"{name}_mma{c}", max_dynamic_smem=smem)
            for kind, name in names.items()
            for c in MMA_BUILDS
        }
        self._fp16 = f.get_function("nq_gemv_fp16")
        self._fp16_mma = {c: f.get_function(f"nq_gemv_fp16_mma{c}", max_dynamic_smem=smem) for c in MMA_BUILDS}
        self._tiles = variant in TILE_VARIANTS and not short_context
        self._core_small_b = tile_core_kinds()
        if self._tiles:
            self._tile = {
                (kind, c): m.get_function(f"{name}_tile{c}", max_dynamic_smem=tile_smem(c))
                for kind, name in names.items()
                for c in TILE_BUILDS
            }
            self._norm_cols = {dims.hidden: m.get_function("nq_norm_cols_h"),
                               dims.intermediate: m.get_function("nq_norm_cols_i")}
            # NQ_TILE_X_PREPERM: the q/k/v and gate/up entries read x in the tile layout, written by this
            self._x_preperm = tile_x_preperm()
            self._norm_cols_wg = m.get_function("nq_norm_cols_wg_h") if self._x_preperm else None
            cp = ck.cupy_module()
            self._tile_min_items = tile_min_items()  # read once: the launches below plan with it
            tiles = max(plan_tiles(kk, units, sms, self._tile_min_items).tiles
                        for units, kk in self._units_by_kind().values())
            # partial sums: 2 slots per block x 64 columns x 128 units x float2; tickets zero between launches
            self._tile_ws = cp.empty(2 * sms * TILE_BUILDS[-1] * TILE_UNITS * 2, dtype=np.float32)
            self._tile_tickets = cp.zeros(tiles, dtype=np.int32)
            self._tile_xn = cp.empty(TILE_BUILDS[-1] * max(dims.hidden, dims.intermediate), dtype=np.float16)

    # ---- the tile GEMM ------------------------------------------------------------------------------

    def _on_tiles(self, kind: str, b: int) -> bool:
        """Whether this matrix kind at B columns runs on the tile GEMM: B > 1 in the tile variants, except
        the kinds of tile_core_kinds() (o_proj) at B <= TILE_CORE_MAX_B, which run on the tensor-core core
        (gemv_mma.cuh)."""
        if not self._tiles or b < 2:
            return False
        return not (b <= TILE_CORE_MAX_B and kind in self._core_small_b)

    def _units_by_kind(self) -> dict[str, tuple[int, int]]:
        """(units, K) of each INT4 matrix kind: o_proj, down_proj, the fused q/k/v and gate/up."""
        d = self.dims
        return {"h": ((d.hidden + 1) // 2, d.hidden), "i": ((d.hidden + 1) // 2, d.intermediate),
                "qkv": (d.qkv_rows // 2, d.hidden), "gu": (d.intermediate, d.hidden)}

    def _launch_tiles(self, kind: str, units: int, k: int, b: int, w_args: tuple, x, norm_w, eps,
                      epi_args: tuple) -> None:
        """The tile GEMM: x normalised first when there is a norm (nq_norm_cols_*), then one launch."""
        if b > TILE_BUILDS[-1]:
            raise KernelError(f"the tile GEMM takes at most {TILE_BUILDS[-1]} columns, got B = {b}")
        ck.check_array("scales", w_args[1], np.float16, align=4)  # 4-byte cp.async of a scale pair
        build = next(c for c in TILE_BUILDS if c >= b)
        if self._x_preperm and kind in ("qkv", "gu"):  # x (normalised or not) in the tile layout
            xn = self._tile_xn[: build * k]
            ck.launch(self._norm_cols_wg, b, THREADS,
                      (x, norm_w if norm_w is not None else ck.NULL, eps, xn, np.int32(build)))
            x = xn
        elif norm_w is not None:
            xn = self._tile_xn[: b * k].reshape(b, k)
            ck.launch(self._norm_cols[k], b, THREADS, (x, norm_w, eps, xn))
            x = xn
        plan = plan_tiles(k, units, ck.sm_count(), self._tile_min_items)
        ck.launch(self._tile[(kind, build)], plan.blocks, tile_threads(),
                  (*w_args, x, *epi_args, np.int32(b), self._tile_ws, self._tile_tickets),
                  shared_mem=tile_smem(build))

    # ---- argument checks ---------------------------------------------------------------------------

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

    def _x(self, x, k: int) -> tuple[int, tuple]:
        """x fp16 [B, K] or [K]: (B, the leading shape outputs take: (B,) or ())."""
        ck.check_array("x", x, np.float16, align=16)
        b = ck.batch_rows("x", x, k)
        if self._b1_only and b > 1:
            raise KernelError(f"the short-context GEMV build runs one sequence (B = 1), got B = {b}")
        return b, (() if x.ndim == 1 else (b,))

    # ---- launches -----------------------------------------------------------------------------------

    def _launch_b1(self, kind: str, units: int, args: tuple, fn=None) -> None:
        """The B = 1 loop (half2, or int8 activations) of one matrix kind over `units` 2-row units: a
        grid-stride grid of even blocks, each running WARPS / split units at once (b1_split: the int8
        loop's warps per unit)."""
        c = self._cluster[kind] if fn is None else 1
        fn = self._half2[kind] if fn is None else fn
        per_block = WARPS // self._split[kind]
        grid = ck.even_grid(fn, -(-units // per_block), THREADS)
        if c > 1:  # whole clusters (the grid-stride walk covers the units at any grid)
            ck.launch(fn, max(c, grid // c * c), THREADS, args, cluster=(c, 1, 1))
            return
        ck.launch(fn, grid, THREADS, args)

    def _launch_mma(self, fn_of, n_units: int, k: int, b: int, args: tuple) -> None:
        """The tensor-core core over n_units units for B columns: plan, grid, launch."""
        tiles = -(-n_units // 8)
        plan = plan_gemv(b, k, tiles, ck.sm_count())
        fn = fn_of(plan.build)
        grid_x = ck.even_grid(fn, tiles, THREADS, plan.smem, copies=plan.passes)
        ck.launch(
            fn,
            (grid_x, plan.passes),
            THREADS,
            (*args, np.int32(b), np.int32(plan.pass_cols), np.int32(plan.slice_groups)),
            shared_mem=plan.smem,
        )

    def _check_image_call(self, b: int, what: str) -> None:
        if not self._a8:
            raise KernelError(f"{what}: the a8 image needs the GEMV variant 'a8', this is {self.variant!r}")
        if b != 1:
            raise KernelError(f"{what}: the a8 image is one sequence's (B = 1), got B = {b}")

    def gemv_int4(self, qweight, scales, x, out, residual=None, norm_w=None, eps=1e-6, x_a8_image=False) -> None:
        """out[B, N] = W . (norm(x[b]) if norm_w else x[b]) (+ residual[B, N]); residual may be out itself.
        x_a8_image (variant "a8", B = 1, K = I, no norm): x's storage holds an a8 image (gate_up_silu's
        a8_image output; a8.a8_image), which down_proj stages as it is."""
        n, k = self._int4(qweight, scales)
        b, lead = self._x(x, k)
        if x_a8_image:
            self._check_image_call(b, "gemv_int4")
            if k != self.dims.intermediate or norm_w is not None:
                raise KernelError("gemv_int4: an a8 image x is down_proj's (K = intermediate, no norm)")
            ck.check_array("out", out, np.float16, (*lead, n))
            if residual is not None:
                ck.check_array("residual", residual, np.float16, (*lead, n))
            ck.check_distinct(x=x, out=out)
            self._launch_b1("i", (n + 1) // 2,
                            (qweight, scales, x, residual if residual is not None else ck.NULL, out, np.int32(n)),
                            fn=self._down_image)
            return
        ck.check_array("out", out, np.float16, (*lead, n))
        if residual is not None:
            ck.check_array("residual", residual, np.float16, (*lead, n))
        if norm_w is not None:
            ck.check_array("norm_w", norm_w, np.float16, (k,), align=16)
        e = ck.check_eps(eps)
        ck.check_distinct(x=x, out=out)
        if residual is not None and residual.data.ptr != out.data.ptr:
            ck.check_distinct(residual=residual, out=out)
        kind = "h" if k == self.dims.hidden else "i"
        args = (
            qweight,
            scales,
            x,
            norm_w if norm_w is not None else ck.NULL,
            e,
            residual if residual is not None else ck.NULL,
            out,
            np.int32(n),
        )
        units = (n + 1) // 2
        if self._on_tiles(kind, b):
            epi = (residual if residual is not None else ck.NULL, out, np.int32(n))
            self._launch_tiles(kind, units, k, b, (qweight, scales), x, norm_w, e, epi)
        elif b == 1 and kind not in self._mma_at_b1:
            self._launch_b1(kind, units, args)
        else:
            self._launch_mma(lambda c: self._mma[(kind, c)], units, k, b, args)

    def qkv_rope_kv(
        self, qweight, scales, bias, x, norm_w, eps, pos_dev, page_table, k_cache, v_cache, layer, q_out,
        settled: bool = False,
    ) -> None:
        """Fused RMSNorm + q/k/v GEMV + bias + RoPE at pos_dev[b] + K/V into the page of pos_dev[b] in
        page_table row b; q of row b to q_out[b]. A row whose position has no page (page id < 0 or past
        the pool, or pos_dev[b] outside the table) writes no K/V and gets NaN q (a padding row).
        settled: the caller promises pos_dev and page_table were written before the previous kernel on the
        stream started (the engine's decode step), so the B = 1 loop reads them before its launch-overlap
        wait (gemv_epilogues.cuh QkvEpi); other paths ignore it."""
        d = self.dims
        rows = d.qkv_rows
        n, _ = self._int4(qweight, scales, d.hidden)
        if n != rows:
            raise KernelError(f"qweight must have {rows} rows (q {d.q_dim} + k + v {d.kv_dim} each), got {n}")
        ck.check_array("bias", bias, np.float16, (rows,))
        b, lead = self._x(x, d.hidden)
        ck.check_array("norm_w", norm_w, np.float16, (d.hidden,), align=16)
        e = ck.check_eps(eps)
        ck.check_array("pos_dev", pos_dev, np.int32, (b,))
        ck.check_array("page_table", page_table, np.int32)
        # one sequence may pass its table as a 1-D array (row 0); a batch passes [B, max_pages]
        ck.check_page_table(page_table, rows=None if b == 1 and page_table.ndim == 1 else b)
        max_pages = int(page_table.shape[-1])
        layer, n_pages = ck.check_kv_cache(d, k_cache, v_cache, layer)
        ck.check_array("q_out", q_out, np.float16, (*lead, d.q_dim))
        ck.check_distinct(x=x, q_out=q_out)
        args = (
            qweight,
            scales,
            bias,
            x,
            norm_w,
            e,
            pos_dev,
            page_table,
            np.int32(max_pages),
            k_cache,
            v_cache,
            np.int32(layer),
            np.int32(n_pages),
            q_out,
        )
        if self._on_tiles("qkv", b):
            self._launch_tiles("qkv", rows // 2, d.hidden, b, (qweight, scales), x, norm_w, e,
                               (bias, *args[6:]))
        elif b == 1 and "qkv" not in self._mma_at_b1:
            self._launch_b1("qkv", rows // 2, (*args, np.int32(1 if settled else 0)))
        else:
            self._launch_mma(lambda c: self._mma[("qkv", c)], rows // 2, d.hidden, b, args)

    def gate_up_silu(self, qweight, scales, x, norm_w, eps, out, a8_image=False) -> None:
        """Fused RMSNorm + gate/up GEMV (rows [0,I) gate, [I,2I) up) + silu(gate) * up into out[B, I].
        a8_image (variant "a8", B = 1): out's storage receives the result as down_proj's a8 image
        (a8.a8_image of the fp16 values: I * 5 / 4 bytes) instead of fp16 values."""
        d = self.dims
        n, _ = self._int4(qweight, scales, d.hidden)
        if n != 2 * d.intermediate:
            raise KernelError(f"qweight must have 2 x intermediate = {2 * d.intermediate} rows, got {n}")
        b, lead = self._x(x, d.hidden)
        if norm_w is not None:
            ck.check_array("norm_w", norm_w, np.float16, (d.hidden,), align=16)
        e = ck.check_eps(eps)
        ck.check_array("out", out, np.float16, (*lead, d.intermediate))
        ck.check_distinct(x=x, out=out)
        args = (qweight, scales, x, norm_w if norm_w is not None else ck.NULL, e, out)
        if a8_image:
            self._check_image_call(b, "gate_up_silu")
            fn = self._gu_image  # a block per group of 32 outputs at a time, A8_IMAGE_GROUPS a block at most
            groups = d.intermediate // A8_BLOCK
            grid = max(ck.even_grid(fn, groups, THREADS), -(-groups // A8_IMAGE_GROUPS))
            ck.launch(fn, grid, THREADS, args)
            return
        if self._on_tiles("gu", b):
            self._launch_tiles("gu", d.intermediate, d.hidden, b, (qweight, scales), x, norm_w, e, (out,))
        elif b == 1 and "gu" not in self._mma_at_b1:
            self._launch_b1("gu", d.intermediate, args)
        else:
            self._launch_mma(lambda c: self._mma[("gu", c)], d.intermediate, d.hidden, b, args)

    def gemv_fp16(self, w, x, out) -> None:
        """out_f32[B, N] = x[B, H] . w[N, H]^T (the lm_head; fp32 logits)."""
        ck.check_array("w", w, np.float16, align=16)
        if w.ndim != 2 or w.shape[1] != self.dims.hidden or w.shape[0] < 1:
            raise KernelError(f"w must be [N, {self.dims.hidden}], got {tuple(w.shape)}")
        n = int(w.shape[0])
        b, lead = self._x(x, self.dims.hidden)
        ck.check_array("out", out, np.float32, (*lead, n))
        units = (n + 1) // 2
        if b == 1:
            grid = ck.even_grid(self._fp16, -(-units // WARPS), THREADS)
            ck.launch(self._fp16, grid, THREADS, (w, x, out, np.int32(n)))
        elif self.lm_head == "blas":
            self._blas.gemm_nt(x, w, out)
        else:
            self._launch_mma(lambda c: self._fp16_mma[c], units, self.dims.hidden, b, (w, x, out, np.int32(n)))
