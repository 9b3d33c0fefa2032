"""CPU check of gemv_mma.cuh's data flow: a numpy emulation of mma.sync m16n8k16 (fragment layouts from the
PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type", as mma.cuh states them) fed exactly
as the kernel feeds it, lane by lane: the staged x with its swizzle and padding, the K slices, the warps'
groups, the per-group scales and the partial sums must give every unit's dot product with every column.
Catches a wrong A/B register order, k-slot pairing, swizzle or column mapping before any GPU run."""

import numpy as np
import pytest
from refs import dequant, pack_valueshuffle

GROUP, WARPS, XPAD = 128, 8, 16


def unpack8(word: int) -> list[tuple[float, float]]:
    """The kernel's unpack8 in numpy: 4 half2 (as float pairs) of q = u - 8 in k order."""
    u = [(word >> (8 * i)) & 0xF for i in range(4)] + [(word >> (8 * i + 4)) & 0xF for i in range(4)]
    q = [v - 8.0 for v in u]
    return [(q[0], q[1]), (q[2], q[3]), (q[4], q[5]), (q[6], q[7])]


def mma16816(a_regs, b_regs):
    """a_regs[lane] = 4 half2 (A), b_regs[lane] = 2 half2 (B) -> d[lane] = 4 floats."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        (a0, a1), (a2, a3), (a4, a5), (a6, a7) = a_regs[lane]
        A[g, 2 * t], A[g, 2 * t + 1] = a0, a1
        A[g + 8, 2 * t], A[g + 8, 2 * t + 1] = a2, a3
        A[g, 2 * t + 8], A[g, 2 * t + 9] = a4, a5
        A[g + 8, 2 * t + 8], A[g + 8, 2 * t + 9] = a6, a7
        (b0, b1), (b2, b3) = b_regs[lane]
        B[2 * t, g], B[2 * t + 1, g] = b0, b1
        B[2 * t + 8, g], B[2 * t + 9, g] = b2, b3
    D = A @ B
    return [
        (
            D[lane // 4, 2 * (lane % 4)],
            D[lane // 4, 2 * (lane % 4) + 1],
            D[lane // 4 + 8, 2 * (lane % 4)],
            D[lane // 4 + 8, 2 * (lane % 4) + 1],
        )
        for lane in range(32)
    ]


def xs_slot(j: int) -> int:
    return j ^ ((j >> 3) & 1)


def emulate_tile(words, scales, x, nt_count, slice_groups):
    """One 16-row tile (units g: rows 2g, 2g+1) of gemv_mma over columns x [ncols, K]; returns the
    epilogue's sums [8 units, 2 rows, ncols] and every shared-memory chunk address each x read used."""
    ncols, K = x.shape
    kG = K // GROUP
    slice_k = slice_groups * GROUP
    row_chunks = (slice_k + XPAD) // 8
    n_slices = -(-kG // slice_groups)
    part = np.zeros((WARPS, 8, 2, 8 * nt_count))
    acc = np.zeros((WARPS, 32, nt_count, 4))
    reads = []  # (warp, wd, nt, lane -> chunk index) per shared-memory read instruction
    for s in range(n_slices):
        xs = np.zeros((ncols * row_chunks, 8))  # stage_slice
        for b in range(ncols):
            for j in range(slice_k // 8):
                k = s * slice_k + 8 * j
                if k < K:
                    xs[b * row_chunks + xs_slot(j)] = x[b, k : k + 8]
        g_lo, g_hi = s * slice_groups, min(kG, (s + 1) * slice_groups)
        for w in range(WARPS):
            for gg in range(g_lo + w, g_hi, WARPS):
                d = np.zeros((32, nt_count, 4))
                for wd in range(4):
                    q0 = [unpack8(int(words[2 * (ln // 4), 16 * gg + 4 * (ln % 4) + wd])) for ln in range(32)]
                    q1 = [unpack8(int(words[2 * (ln // 4) + 1, 16 * gg + 4 * (ln % 4) + wd])) for ln in range(32)]
                    slots = [xs_slot((gg - g_lo) * 16 + 4 * (ln % 4) + wd) for ln in range(32)]
                    for nt in range(nt_count):
                        if 8 * nt >= ncols:
                            break
                        xv = []
                        for ln in range(32):
                            col = 8 * nt + ln // 4
                            xv.append(xs[col * row_chunks + slots[ln]] if col < ncols else np.zeros(8))
                        reads.append(
                            [(8 * nt + ln // 4) * row_chunks + slots[ln] if 8 * nt + ln // 4 < ncols else None
                             for ln in range(32)]
                        )
                        for half in range(2):
                            i0, i1 = 2 * half, 2 * half + 1
                            a = [(q0[ln][i0], q1[ln][i0], q0[ln][i1], q1[ln][i1]) for ln in range(32)]
                            bb = [((xv[ln][4 * half], xv[ln][4 * half + 1]), (xv[ln][4 * half + 2], xv[ln][4 * half + 3]))
                                  for ln in range(32)]
                            out = mma16816(a, bb)
                            for ln in range(32):
                                d[ln, nt] += out[ln]
                for ln in range(32):
                    u = ln // 4
                    s0, s1 = float(scales[2 * u, gg]), float(scales[2 * u + 1, gg])
                    acc[w, ln] += d[ln] * np.array([s0, s0, s1, s1])
    for w in range(WARPS):
        for ln in range(32):
            g, c = ln // 4, ln % 4
            for nt in range(nt_count):
                part[w, g, 0, 8 * nt + 2 * c : 8 * nt + 2 * c + 2] = acc[w, ln, nt, :2]
                part[w, g, 1, 8 * nt + 2 * c : 8 * nt + 2 * c + 2] = acc[w, ln, nt, 2:]
    return part.sum(axis=0)[:, :, :ncols], reads


@pytest.mark.parametrize(
    "ncols, nt_count, K, slice_groups",
    [(1, 1, 1024, 8), (5, 1, 2048, 8), (11, 4, 2048, 16), (11, 4, 2048, 8), (32, 4, 1152, 9)],
    ids=["B1", "B5-sliced", "B11-whole", "B11-sliced", "B32-tail"],
)
def test_gemv_mma_tile_matches_reference(rng, ncols, nt_count, K, slice_groups):
    u = rng.integers(0, 16, size=(16, K), dtype=np.uint8)
    words = pack_valueshuffle(u)
    scales = rng.uniform(0.5, 1.5, size=(16, K // GROUP)).astype(np.float16)
    x = rng.standard_normal((ncols, K)).astype(np.float16).astype(np.float64)
    got, _ = emulate_tile(words, scales, x, nt_count, slice_groups)
    ref = dequant(u, scales).astype(np.float64) @ x.T  # [16 rows, ncols]
    np.testing.assert_allclose(got[:, 0, :], ref[0::2], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(got[:, 1, :], ref[1::2], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("ncols", [8, 16, 32])
def test_staged_x_reads_are_bank_conflict_free(rng, ncols):
    """Each quarter-warp's 16-byte reads of staged x hit 8 distinct 16-byte bank groups (of 8)."""
    K = 1024
    words = pack_valueshuffle(rng.integers(0, 16, size=(16, K), dtype=np.uint8))
    scales = np.ones((16, K // GROUP), np.float16)
    _, reads = emulate_tile(words, scales, np.zeros((ncols, K)), 4, K // GROUP)
    assert reads
    for chunks in reads:
        for q in range(4):
            banks = [(c * 16 // 16) % 8 for c in chunks[8 * q : 8 * q + 8] if c is not None]
            assert len(set(banks)) == len(banks), f"bank conflict in quarter {q}: {banks}"
