"""The fused INT4 prefill GEMM's launch plan (cuda/gemm_int4_prefill.cu): tile width, grid, shared memory.

Pure arithmetic, no GPU: the tests run it on the CPU, the launcher (prefill.py gemm_int4_wg) on every call.
A block computes 128 weight rows x BN tokens (BN = 256, 128 or 64: the kernel's NT = BN / 8 build) with one
block per SM, so the grid is ceil(T / BN) x ceil(N / 128) blocks in waves of `sms`. choose_tile picks the
BN with the least estimated time: waves x BN / efficiency(BN), the efficiency being what a narrower tile
loses (per k, each warpgroup's wgmma reads the X tile once for 64 rows: a narrower tile reads the same
weights for fewer tokens, and pays the fragment dequantization and the per-stage overhead over less work).
"""

from __future__ import annotations

import os

from .errors import KernelError

GW_THREADS = 384  # two consumer warpgroups + one producer warpgroup
GW_ROWS = 128  # weight rows per block
GW_STAGES = 5  # ring depth (the kernel's NQ_GW_STAGES, passed as a define)
GW_WIDTHS = (256, 128, 64)  # tokens per block: the entries nq_gemm_int4_wg_n256 / _n128 / _n64
# Relative throughput of a full wave at each width (used only to rank the widths for a shape); a first
# estimate, to be replaced by measured figures (docs/PERF.md)
GW_EFFICIENCY = {256: 1.0, 128: 0.85, 64: 0.65}
_EPI_PITCH = 132  # floats per token of the epilogue's staging


def stage_bytes(bn: int) -> int:
    """One ring stage: X (bn tokens x 128 B), W (128 rows x 32 B), scales (128 x 4 B), rounded to 1 KB."""
    raw = bn * 128 + GW_ROWS * 32 + GW_ROWS * 4
    return (raw + 1023) // 1024 * 1024


def smem_bytes(bn: int, stages: int = GW_STAGES) -> int:
    """Dynamic shared memory of a launch of width bn (the kernel's gw::smem_bytes)."""
    return max(stages * stage_bytes(bn), bn * _EPI_PITCH * 4) + 1024


def grid(t: int, n: int, bn: int) -> tuple[int, int, int]:
    """Token tiles along x (adjacent blocks share a weight tile, so it comes from HBM about once), weight
    row tiles along y."""
    return (-(-t // bn), -(-n // GW_ROWS), 1)


def choose_tile(t: int, n: int, sms: int) -> int:
    """The tile width for T tokens and N weight rows on `sms` SMs ($NANOQWEN_GEMM_TILE forces one)."""
    forced = os.environ.get("NANOQWEN_GEMM_TILE")
    if forced:
        if not forced.isdigit() or int(forced) not in GW_WIDTHS:
            raise KernelError(f"NANOQWEN_GEMM_TILE must be one of {GW_WIDTHS}, got {forced!r}")
        return int(forced)
    best, best_cost = GW_WIDTHS[0], None
    for bn in GW_WIDTHS:
        gx, gy, _ = grid(t, n, bn)
        waves = -(-(gx * gy) // sms)
        cost = waves * bn / GW_EFFICIENCY[bn]  # a block computes all bn columns, padding or not
        if best_cost is None or cost < best_cost:
            best, best_cost = bn, cost
    return best
