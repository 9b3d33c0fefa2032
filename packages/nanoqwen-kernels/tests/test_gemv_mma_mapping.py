"""CPU check of gemv_int4_mma.cuh's data flow: a numpy emulation of mma.sync m16n8k16 (fragment layouts
from the PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type") fed exactly as the
kernel feeds it, lane by lane, must give each unit's group dot products in the lanes the kernel reads
them from. Catches a wrong A/B register order or k-slot pairing before any GPU run."""

import numpy as np
from refs import pack_valueshuffle


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


def test_group_mma_lane_mapping():
    rng = np.random.default_rng()
    rows = rng.integers(0, 16, size=(16, 128), dtype=np.uint8)  # unit ul: rows 2ul (r0), 2ul+1 (r1)
    words = pack_valueshuffle(rows)  # [16, 16]: piece c of a row = words 4c .. 4c+3
    x = rng.standard_normal(128)
    d = [[0.0] * 4 for _ in range(32)]
    for wd in range(4):  # group_mma's word loop
        for half in range(2):  # the two mmas of a word
            a_regs, b_regs = [], []
            for lane in range(32):
                ul, c = lane // 4, lane % 4
                q0 = unpack8(int(words[2 * ul, 4 * c + wd]))
                q1 = unpack8(int(words[2 * ul + 1, 4 * c + wd]))
                xk = 32 * c + 8 * wd  # first k of this word
                xh = [(x[xk + 2 * i], x[xk + 2 * i + 1]) for i in range(4)]
                i0, i1 = 2 * half, 2 * half + 1
                a_regs.append((q0[i0], q1[i0], q0[i1], q1[i1]))
                b_regs.append((xh[i0], xh[i1]))
            out = mma16816(a_regs, b_regs)
            for lane in range(32):
                d[lane] = [d[lane][i] + out[lane][i] for i in range(4)]
    ref = (rows.astype(np.float64) - 8) @ x
    for lane in range(32):
        ul = lane // 4
        np.testing.assert_allclose(d[lane][0], ref[2 * ul], rtol=1e-12, atol=1e-9)
        np.testing.assert_allclose(d[lane][2], ref[2 * ul + 1], rtol=1e-12, atol=1e-9)
