"""The tile GEMM's plan (cuda/gemm_tiles.cuh, the INT4 GEMVs at B > 1): how its blocks stripe over a
matrix's tiles (`plan_tiles`, which depends on the matrix and the GPU, never on B), and the block shape and
shared memory its builds launch with (`tile_threads`, `tile_stages`, `tile_smem`), each following the
$NANOQWEN_KERNEL_DEFINES knobs its build was compiled with. gemv.py launches it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from .dims import GROUP
from .errors import KernelError
from .loader import extra_defines

TILE_BUILDS = (8, 16, 32, 64)  # columns of its entries (suffix _tile8 .. _tile64); B <= 64
TILE_UNITS = 128  # units (2 rows) per tile: 16 warps x 1 m16 tile x 8 units
TILE_THREADS = 512  # gemm_tiles.cuh kTileThreads: the 16 consumer warps
TILE_PRODUCERS = 4  # gemm_tiles.cuh NQ_TILE_PRODUCERS default: the copy warps beside them
TILE_STAGES = 8  # gemm_tiles.cuh NQ_TILE_STAGES default (at most; fewer where they do not fit the cap)
TILE_SMEM_CAP = 220 * 1024  # gemm_tiles.cuh kTileSmemCap
TILE_SMEM_ALIGN = 1024  # gemm_tiles.cuh kTileSmemAlignPad: the ring aligned for x's swizzle atoms
# Work items (256-k steps of a tile) per block at least: a small matrix (o_proj, q/k/v) then runs on fewer
# blocks with fewer contributors per tile for the last block to add up. $NANOQWEN_TILE_MIN_ITEMS overrides
# it (an A/B knob: it changes P, hence the order partial sums are added in, for every B alike)
TILE_MIN_ITEMS = 2


def tile_min_items() -> int:
    """TILE_MIN_ITEMS, or $NANOQWEN_TILE_MIN_ITEMS (a positive integer)."""
    raw = os.environ.get("NANOQWEN_TILE_MIN_ITEMS", "")
    if not raw:
        return TILE_MIN_ITEMS
    if not raw.isdigit() or int(raw) < 1:
        raise KernelError(f"NANOQWEN_TILE_MIN_ITEMS={raw!r}: expected a positive integer")
    return int(raw)


def tile_threads() -> int:
    """Threads of a tile GEMM block (gemm_tiles.cuh kTileBlockThreads): the 16 consumer warps and
    NQ_TILE_PRODUCERS producer warps (a $NANOQWEN_KERNEL_DEFINES knob, default TILE_PRODUCERS)."""
    return TILE_THREADS + 32 * extra_defines().get("NQ_TILE_PRODUCERS", TILE_PRODUCERS)


def tile_x_preperm() -> bool:
    """Whether the q/k/v and gate/up tile entries read x pre-permuted into the tile layout (gemm_tiles.cuh
    NQ_TILE_X_PREPERM, a $NANOQWEN_KERNEL_DEFINES knob, default on), written by nq_norm_cols_wg_h."""
    return bool(extra_defines().get("NQ_TILE_X_PREPERM", 1))


def tile_stages(cols: int) -> int:
    """Ring stages of the build for `cols` columns (gemm_tiles.cuh tile_stages): NQ_TILE_STAGES (default
    TILE_STAGES), fewer where they would not fit TILE_SMEM_CAP (5 / 5 / 4 / 3 at 8 / 16 / 32 / 64)."""
    return min(extra_defines().get("NQ_TILE_STAGES", TILE_STAGES), TILE_SMEM_CAP // _tile_stage_bytes(cols))


def _tile_stage_bytes(cols: int) -> int:
    slots = 2 * TILE_UNITS
    return slots * 128 + slots * 4 + cols * 2 * 2 * GROUP  # weights, scales, x of a 256-k pair


def tile_smem(cols: int) -> int:
    """Dynamic shared memory of the tile GEMM built for `cols` columns (gemm_tiles.cuh tile_stage_bytes
    x stages, and kTileSmemAlignPad)."""
    return tile_stages(cols) * _tile_stage_bytes(cols) + TILE_SMEM_ALIGN


@dataclass(frozen=True)
class TilePlan:
    """How the tile GEMM covers one matrix: `blocks` stripes over tiles x pairs work items."""

    tiles: int  # 256-row tiles
    pairs: int  # 256-k steps per tile (pairs of 128-k groups)
    blocks: int  # P: grid.x, one block per SM at most

    @property
    def items(self) -> int:
        return self.tiles * self.pairs

    def stripe(self, b: int) -> tuple[int, int]:
        """Work items [lo, hi) of block b (gemm_tiles.cuh stripe_lo)."""
        return b * self.items // self.blocks, (b + 1) * self.items // self.blocks


def plan_tiles(k: int, units: int, sm_count: int, min_items: int | None = None) -> TilePlan:
    """The tile GEMM's stripes for a K-long matrix of `units` 2-row units. Depends on the matrix and the
    GPU only, never on B: a column's partial sums are then added in the same order at every batch size.
    One block per SM (P <= SMs), and at least `min_items` (default tile_min_items()) work items per block
    (so >= 1, which the tickets' contributor count relies on)."""
    if k % GROUP or units < 1 or sm_count < 1:
        raise KernelError(f"plan_tiles: bad shape K={k} units={units} SMs={sm_count}")
    return _plan_tiles(k, units, sm_count, tile_min_items() if min_items is None else min_items)


@functools.cache
def _plan_tiles(k: int, units: int, sm_count: int, min_items: int) -> TilePlan:
    tiles = -(-units // TILE_UNITS)
    pairs = -(-(k // GROUP) // 2)
    return TilePlan(tiles, pairs, max(1, min(sm_count, tiles * pairs // min_items)))
