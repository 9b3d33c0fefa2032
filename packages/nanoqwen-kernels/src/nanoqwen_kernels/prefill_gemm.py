"""The fused INT4 prefill GEMM's launch plan (cuda/gemm_int4_prefill.cu): tile width, grid, shared memory.

Pure arithmetic, no GPU: the tests run it on the CPU, the launcher (prefill.py gemm_int4_wg) on every call.
A block computes 128 weight rows x BN tokens (BN = 256, 128 or 64: the kernel's NT = BN / 8 build) with one
block per SM, so the grid is ceil(T / BN) x ceil(N / 128) x S blocks in waves of `sms`, S the split-K
factor: with S > 1 split z takes K's groups [z G / S, (z + 1) G / S), writes fp32 partial sums into a
workspace [S, T, N], and a second launch (nq_gemm_splitk_reduce) adds them in order. Why: a short prompt
on a narrow matrix has few tiles (the 7B's q/k/v at T = 512: 36 x 2 = 72 blocks for 132 SMs), and split-K
multiplies the blocks without narrowing the tile. choose_plan picks (BN, S) with the least estimated time:
waves x (stages per block + a fixed cost) x the time of a stage at that width, plus the reduction's bytes.

The FP8 GEMM (cuda/gemm_fp8_prefill.cu, opt-in) has the same tiles and split-K; its stage is a whole group
of 128 k, its widths 128 and 64 tokens (GF8_*), and choose_plan_fp8 picks with its own rates. Its blocks are
persistent (fp8_grid: one per SM, each walking the tiles in the kernel's banded order), so a block's ring
fills the next tile's stages during this one's epilogue.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from .errors import KernelError

GW_THREADS = 384  # two consumer warpgroups + one producer warpgroup
GW_ROWS = 128  # weight rows per block
GW_STAGES = 6  # ring depth (the kernel's NQ_GW_STAGES, passed as a define; 4 / 5 / 6 measured equal within 2%)
GW_WIDTHS = (256, 128, 64)  # tokens per block: the entries nq_gemm_int4_wg_n256 / _n128 / _n64
# Relative throughput of a wave at each width, fitted to the H200 sweep of every (width, splits) plan on the
# 7B and 1.5B shapes at T = 512 and 2048 (bench_prefill_gemm.py --sweep, docs/PERF.md "eleventh lease"):
# with these, choose_plan picks the measured fastest plan (or one within 1%) for all 16 of them
GW_EFFICIENCY = {256: 1.0, 128: 0.73, 64: 0.45}
GW_SPLITS = (1, 2, 3, 4, 6, 8)
GW_STAGE_OVERHEAD = 3  # a block's fixed cost (ring fill, epilogue), in stages of its width
_MAC_RATE_SM = 2.6e12  # multiply-adds per second of one SM at n256 (~690 TFLOP/s over 132 SMs, X by TMA)
_REDUCE_BYTES_RATE = 2.5e12  # the reduction's fp32 reads + fp16 writes, bytes per second (L2-resident mostly)
WORKSPACE_CAP = 64 << 20  # bytes of fp32 partial sums a plan may ask for
_EPI_PITCH = 132  # floats per token of the epilogue's staging


GF8_THREADS = 384  # the FP8 GEMM: two consumer warpgroups + one producer warpgroup
GF8_MAX_STAGES = 6  # the kernel's gf8::kMaxStages
# Row blocks per band of the persistent FP8 tile order (the kernel's Unit): the 132 tiles running at once
# cover 8 row blocks x ~16 token blocks, so a band's weights (8 x 128 rows) stay in L2 while its token blocks
# stream. Band 1 (every token block of a row block before the next: the old grid's order) rereads all of X
# for each pair of row blocks; on down at 8,192 tokens (X = 155 MB of e4m3, beyond the 50 MB L2) band 8 ran
# 1,180-1,214 TFLOP/s against 1,048-1,107 for band 1, and a 7B 8k prefill 145.8-146.2 ms against
# 150.0-151.1 (bands 4 and 16 within 1% of 8; H200, docs/PERF.md fifteenth lease).
GF8_BAND = 8
GF8_SMEM_MAX = 227 * 1024  # an H100/H200 block's dynamic shared memory
_EPI_SILU_PITCH = 68  # the SiLU build's staging: 64 outputs + 4
GF8_WIDTHS = (128, 64)  # nq_gemm_fp8_wg_n128 / _n64 (256 would need 256 accumulator registers: see the kernel)
GF8_EFFICIENCY = {128: 1.0, 64: 0.6}
_FP8_MAC_RATE_SM = 4.2e12  # ~1,100 TFLOP/s over 132 SMs at n128 (7B gate/up and down at T = 512, H200)


def stage_bytes(bn: int) -> int:
    """One ring stage: X (bn tokens x 128 B), W (128 rows x 32 B), scales (128 x 4 B), rounded to 1 KB."""
    raw = bn * 128 + GW_ROWS * 32 + GW_ROWS * 4
    return (raw + 1023) // 1024 * 1024


def smem_bytes(bn: int, stages: int = GW_STAGES) -> int:
    """Dynamic shared memory of a launch of width bn (the kernel's gw::smem_bytes)."""
    return max(stages * stage_bytes(bn), bn * _EPI_PITCH * 4) + 1024


def fp8_stage_bytes(bn: int) -> int:
    """One FP8 ring stage: X (bn x 128 B), W (128 x 128 B), the rows' group scales (f32), to 1 KB."""
    raw = bn * 128 + GW_ROWS * 128 + GW_ROWS * 4
    return (raw + 1023) // 1024 * 1024


def fp8_staging_bytes(bn: int, silu: bool) -> int:
    """The FP8 epilogue's own staging (fp32 [bn][pitch], to 1 KB): apart from the ring, which the producer
    is filling with the next tile's stages while the epilogue runs."""
    raw = bn * (_EPI_SILU_PITCH if silu else _EPI_PITCH) * 4
    return (raw + 1023) // 1024 * 1024


def fp8_stages(bn: int, silu: bool) -> int:
    """The FP8 ring's depth (the kernel's gf8::stages): what fits beside the staging, at most GF8_MAX_STAGES."""
    return min(GF8_MAX_STAGES, (GF8_SMEM_MAX - 1024 - fp8_staging_bytes(bn, silu)) // fp8_stage_bytes(bn))


def fp8_smem_bytes(bn: int, silu: bool) -> int:
    """Dynamic shared memory of an FP8 launch (the kernel's gf8::smem_bytes): ring + staging + alignment."""
    return fp8_stages(bn, silu) * fp8_stage_bytes(bn) + fp8_staging_bytes(bn, silu) + 1024


def fp8_units(t: int, n: int, bn: int, splits: int = 1) -> int:
    """Tiles of an FP8 launch: token blocks x row blocks x K splits."""
    gx, gy, gz = grid(t, n, bn, splits)
    return gx * gy * gz


def fp8_grid(t: int, n: int, bn: int, splits: int, sms: int) -> tuple[int, int, int]:
    """Persistent: one block per SM (fewer when there are fewer tiles); block b runs tiles b, b + grid, ..
    Against the kernel before (a block per tile, its epilogue staged in the drained ring), same call, 7B at
    8,192 tokens: gate/up 917-998 -> 1,134 TFLOP/s, down 1,061-1,090 -> 1,214, q/k/v and o_proj equal
    within the calls' spread (H200, docs/PERF.md fifteenth lease)."""
    return (min(fp8_units(t, n, bn, splits), sms), 1, 1)


def grid(t: int, n: int, bn: int, splits: int = 1) -> tuple[int, int, int]:
    """Token tiles along x (adjacent blocks share a weight tile, so it comes from HBM about once), weight
    row tiles along y, K splits along z."""
    return (-(-t // bn), -(-n // GW_ROWS), splits)


def plan_cost(t: int, n: int, k: int, bn: int, splits: int, sms: int, fp8: bool = False) -> float:
    """Estimated seconds of the GEMM (+ its reduction when split) for one (width, splits); fp8: the FP8
    GEMM's (a stage is a whole group)."""
    gx, gy, _ = grid(t, n, bn, splits)
    waves = -(-(gx * gy * splits) // sms)
    if fp8:
        stages = -(-(k // 128) // splits)
        t_stage = GW_ROWS * bn * 128 / (_FP8_MAC_RATE_SM * GF8_EFFICIENCY[bn])
    else:
        stages = 2 * -(-(k // 128) // splits)
        t_stage = GW_ROWS * bn * 64 / (_MAC_RATE_SM * GW_EFFICIENCY[bn])
    cost = waves * (stages + GW_STAGE_OVERHEAD) * t_stage
    if splits > 1:
        cost += (t * n * 4 * (splits + 1) + t * n * 2) / _REDUCE_BYTES_RATE + 2e-6
    return cost


def choose_plan(t: int, n: int, k: int, sms: int, split_ok: bool = True) -> tuple[int, int]:
    """(tile width, K splits) for T tokens, N rows, K inputs on `sms` SMs: the least plan_cost among the
    widths and the splits that leave each split >= 2 groups and fit WORKSPACE_CAP ($NANOQWEN_GEMM_TILE /
    $NANOQWEN_GEMM_SPLITS force either); split_ok False (the SiLU build): one split. Memoized: every
    prefill launch asks (~14 us of Python a plan)."""
    return _plan(t, n, k, sms, split_ok, os.environ.get("NANOQWEN_GEMM_TILE"), os.environ.get("NANOQWEN_GEMM_SPLITS"))


def resolve_plan(t: int, n: int, k: int, sms: int, tile: int | None, splits, fp8: bool = False) -> tuple[int, int]:
    """(tile, splits) of a launch: those given, the rest from choose_plan (or choose_plan_fp8); splits must
    be an int in 1 .. K / 128 (KernelError otherwise). The width itself is checked by the launcher."""
    if tile is None or splits is None:
        bn, s = (choose_plan_fp8 if fp8 else choose_plan)(t, n, k, sms)
        tile = bn if tile is None else tile
        splits = s if splits is None else splits
    if isinstance(splits, bool) or not isinstance(splits, int | np.integer) or not 1 <= splits <= k // 128:
        raise KernelError(f"splits must be an int in 1 .. K / 128 = {k // 128}, got {splits!r}")
    return tile, int(splits)


def choose_plan_fp8(t: int, n: int, k: int, sms: int, split_ok: bool = True) -> tuple[int, int]:
    """choose_plan for the FP8 GEMM (widths GF8_WIDTHS; $NANOQWEN_GEMM_TILE / _SPLITS force them too)."""
    return _plan(t, n, k, sms, split_ok, os.environ.get("NANOQWEN_GEMM_TILE"), os.environ.get("NANOQWEN_GEMM_SPLITS"),
                 fp8=True)


@functools.lru_cache(maxsize=1024)
def _plan(t: int, n: int, k: int, sms: int, split_ok: bool, tile_env: str | None,
          splits_env: str | None, fp8: bool = False) -> tuple[int, int]:
    all_widths = GF8_WIDTHS if fp8 else GW_WIDTHS
    widths = (_forced("NANOQWEN_GEMM_TILE", tile_env, all_widths),) if tile_env else all_widths
    if not split_ok:
        splits_all: tuple[int, ...] = (1,)
    elif splits_env:
        splits_all = (_forced("NANOQWEN_GEMM_SPLITS", splits_env, GW_SPLITS),)
    else:
        splits_all = tuple(s for s in GW_SPLITS if s == 1 or (k // 128 >= 2 * s and s * t * n * 4 <= WORKSPACE_CAP))
    best = min((plan_cost(t, n, k, bn, s, sms, fp8), bn, s) for bn in widths for s in splits_all)
    return best[1], best[2]


def _forced(var: str, v: str, allowed: tuple[int, ...]) -> int:
    if not v.isdigit() or int(v) not in allowed:
        raise KernelError(f"{var} must be one of {allowed}, got {v!r}")
    return int(v)
