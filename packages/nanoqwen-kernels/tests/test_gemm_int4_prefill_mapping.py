"""CPU check of the fused INT4 prefill GEMM's data flow (cuda/gemm_int4_prefill.cu), emulated in numpy exactly
as the kernel moves the bytes: the TMA box of X (the 128-byte swizzle, zeros past T) and the producers'
copies of W and the scale pairs into a ring stage (their byte offsets, swizzles and clamps), each consumer lane's A fragments (dq_pair: shift, mask, prmt selector,
1032 bias, scale from the pair's half picked by parity) and wgmma's reads of X through the stage's
descriptor (128-byte swizzle, 32 bytes per k16 step). The emulated tile must equal X . W^T for every row
and token; the copies must cover the stage once; a warp's W loads must hit 8 distinct 16-byte bank groups.
Catches a wrong offset, XOR, nibble pair or parity before a GPU run."""

import numpy as np
import pytest
from nanoqwen_kernels import prefill_gemm as pg
from refs import dequant, pack_valueshuffle, random_int4

BM, BK, GROUP = 128, 64, 128


def producer_stage(X, qw, sc_flat, G, t0, row0, k0, bn, T, N, K, rowmap=None):
    """The stage as the producer warpgroup's copies leave it: (stage bytes, times each byte was written)."""
    xb = bn * 128
    size = pg.stage_bytes(bn)
    st = np.zeros(size, dtype=np.uint8)
    written = np.zeros(size, dtype=int)
    xbytes = X.view(np.uint8).reshape(X.shape[0], -1)
    qbytes = qw.view(np.uint8).reshape(qw.shape[0], -1)
    sbytes = sc_flat.view(np.uint8)

    def put(off, src):
        st[off:off + len(src)] = src
        written[off:off + len(src)] += 1

    # X: the TMA box [bn tokens][64 k] in the 128-byte swizzle (rows past T: zeros)
    for n in range(bn):
        for ch in range(8):
            tok = t0 + n
            src = xbytes[tok, 2 * (k0 + 8 * ch):2 * (k0 + 8 * ch) + 16] if tok < T else np.zeros(16, np.uint8)
            put(1024 * (n >> 3) + 128 * (n & 7) + 16 * (ch ^ (n & 7)), src)
    rowmap = rowmap or (lambda r: min(row0 + r, N - 1))
    for pt in range(128):  # the producer warpgroup's threads: W and S
        j = pt & 1
        wo0 = (pt >> 1) * 32 + 16 * (j ^ (((pt >> 1) >> 2) & 1))
        w0 = k0 // 8 + 4 * j
        for r, wo in ((pt >> 1, wo0), ((pt >> 1) + 64, wo0 + 64 * 32)):
            put(xb + wo, qbytes[rowmap(r), 4 * w0:4 * w0 + 16])
        e = rowmap(pt) * G + k0 // GROUP
        put(xb + BM * 32 + 4 * pt, sbytes[2 * (e & ~1):2 * (e & ~1) + 4])
    return st, written


def dq_pair(w: int, shift: int, sel: int, s2: np.ndarray) -> np.ndarray:
    """The kernel's dq_pair on one lane: two fp16 values."""
    v = (w >> shift) & 0x0F0F0F0F
    b = [(v >> (8 * i)) & 0xFF for i in range(4)]
    lo, hi = (b[0], b[1]) if sel == 0x4140 else (b[2], b[3])
    h = np.array([0x6400 | lo, 0x6400 | hi], dtype=np.uint16).view(np.float16)
    q = h - np.float16(1032.0)  # exact
    return (q * s2).astype(np.float16)  # one rounding (numpy: fp32 product of two fp16 is exact, then round)


def lane_frags(st, xb, r0, r1, p0, p1, c):
    """load_frags for lane (g, c) with fragment rows r0, r1: 16 registers of 2 fp16 each."""
    shift, sel = 4 * (c >> 1), 0x4342 if c & 1 else 0x4140
    words = st[xb:xb + BM * 32].view(np.uint32)

    def row_words(r):
        out = []
        for j in range(2):
            off = r * 32 + 16 * (j ^ ((r >> 2) & 1))
            out += list(words[off // 4:off // 4 + 4])
        return out

    sw = st[xb + BM * 32:xb + BM * 36].view(np.uint32)
    sa = np.array([(int(sw[r0]) >> p0) & 0xFFFF], dtype=np.uint16).view(np.float16)[0]
    sb = np.array([(int(sw[r1]) >> p1) & 0xFFFF], dtype=np.uint16).view(np.float16)[0]
    wa, wb = row_words(r0), row_words(r1)
    f = []
    for j in range(4):
        f += [dq_pair(int(wa[2 * j]), shift, sel, sa), dq_pair(int(wb[2 * j]), shift, sel, sb),
              dq_pair(int(wa[2 * j + 1]), shift, sel, sa), dq_pair(int(wb[2 * j + 1]), shift, sel, sb)]
    return f


def read_x(st, j, bn):
    """B (16 k x bn tokens) of k16 step j as wgmma reads it through the stage's descriptor (+2 j: 32 B)."""
    b = np.zeros((16, bn))
    xh = st[:bn * 128].view(np.float16)
    for n in range(bn):
        for kk in range(16):
            o = (n >> 3) * 1024 + (n & 7) * 128 + 32 * j + 2 * kk
            o ^= ((o >> 7) & 7) << 4
            b[kk, n] = xh[o // 2]
    return b


def silu_rowmap(y: int, n: int):
    """The SiLU build's tile_row: tile y's row r -> gate row a or up row I + a, a = 64 y + 8 (r / 16) + r % 8."""
    i_half = n // 2

    def rowmap(r):
        a = min(64 * y + 8 * (r >> 4) + (r & 7), i_half - 1)
        return i_half + a if (r >> 3) & 1 else a

    return rowmap


def emulate_tile(X, qw, sc, t0, row0, bn, K, rowmap=None):
    T, N = X.shape[0], qw.shape[0]
    G = K // GROUP
    rowmap = rowmap or (lambda r: min(row0 + r, N - 1))
    acc = np.zeros((BM, bn))
    for i in range(K // BK):
        k0 = i * BK
        st, written = producer_stage(X, qw, np.ascontiguousarray(sc).reshape(-1), G, t0, row0, k0, bn, T, N, K,
                                     rowmap)
        used = bn * 128 + BM * 36
        assert written[:used].min() == 1 and written.max() == 1, "the copies must fill the stage once"
        B = [read_x(st, j, bn) for j in range(4)]
        for wg in range(2):
            for wq in range(4):
                A = np.zeros((4, 64, 16))  # [step][row of the warpgroup][k]
                for lane in range(32):
                    g, c = lane >> 2, lane & 3
                    r0 = 64 * wg + 16 * wq + g
                    r1 = r0 + 8
                    e0, e1 = rowmap(r0) * G, rowmap(r1) * G
                    gi = k0 // GROUP
                    f = lane_frags(st, bn * 128, r0, r1, 16 * ((e0 + gi) & 1), 16 * ((e1 + gi) & 1), c)
                    for j in range(4):
                        a0, a1, a2, a3 = f[4 * j:4 * j + 4]
                        rr0, rr1 = 16 * wq + g, 16 * wq + g + 8
                        A[j, rr0, 2 * c:2 * c + 2] = a0
                        A[j, rr1, 2 * c:2 * c + 2] = a1
                        A[j, rr0, 2 * c + 8:2 * c + 10] = a2
                        A[j, rr1, 2 * c + 8:2 * c + 10] = a3
                for j in range(4):
                    rows = slice(64 * wg + 16 * wq, 64 * wg + 16 * wq + 16)
                    acc[rows] += A[j, 16 * wq:16 * wq + 16] @ B[j]
    return acc


@pytest.mark.parametrize("bn,T,N,K,t0,row0", [(64, 70, 136, 256, 64, 0), (64, 40, 136, 384, 0, 128),
                                               (128, 128, 128, 256, 0, 0)])
def test_emulated_tile_is_x_times_w(rng, bn, T, N, K, t0, row0):
    """Tiles with tokens past T (zeros) and rows past N (clamped), an odd group count (K = 384: the scale
    pairs' parity alternates along a row)."""
    u, s = random_int4(rng, N, K, scale=0.1)
    qw = pack_valueshuffle(u)
    w = dequant(u, s).astype(np.float16).astype(np.float64)
    X = rng.standard_normal((T, K)).astype(np.float16)
    acc = emulate_tile(X, qw, s, t0, row0, bn, K)
    rows = np.minimum(np.arange(row0, row0 + BM), N - 1)
    xt = np.zeros((bn, K))
    live = min(bn, T - t0)
    xt[:live] = X.astype(np.float64)[t0:t0 + live]
    ref = w[rows] @ xt.T
    np.testing.assert_allclose(acc, ref, rtol=1e-9, atol=1e-9)


def test_silu_rows_pair_each_gate_with_its_up_in_one_lane(rng):
    """The SiLU build's row map: the emulated tile's fragment rows g / g + 8 of every lane hold output a's
    gate and up sums (a = 64 y + 8 (r0 / 16) + g, the epilogue's index), so silu(gate) * up is the MLP's
    activation; every output of the tile appears once."""
    K, n_out, T, bn = 256, 192, 40, 64
    u, s = random_int4(rng, 2 * n_out, K, scale=0.1)
    qw = pack_valueshuffle(u)
    w = dequant(u, s).astype(np.float16).astype(np.float64)
    X = rng.standard_normal((T, K)).astype(np.float16)
    xt = np.zeros((bn, K))
    xt[:T] = X.astype(np.float64)
    seen = []
    for y in range(n_out // 64):
        acc = emulate_tile(X, qw, s, 0, 0, bn, K, silu_rowmap(y, 2 * n_out))
        for r0 in [64 * wg + 16 * wq + g for wg in range(2) for wq in range(4) for g in range(8)]:
            a = 64 * y + 8 * (r0 >> 4) + (r0 & 7)
            np.testing.assert_allclose(acc[r0], w[a] @ xt.T, rtol=1e-9, atol=1e-9)  # gate
            np.testing.assert_allclose(acc[r0 + 8], w[n_out + a] @ xt.T, rtol=1e-9, atol=1e-9)  # up
            seen.append(a)
    assert sorted(seen) == list(range(n_out))


def test_w_loads_spread_over_the_banks():
    """load_frags' four 16-byte loads: per instruction the 8 rows g = 0..7 of a warp (each read by its 4
    lanes: a broadcast) land in 8 different 16-byte bank groups."""
    for base in range(0, BM, 16):
        for j in range(2):
            for second in (0, 8):
                groups = {((base + second + g) * 32 + 16 * (j ^ (((base + second + g) >> 2) & 1))) % 128 // 16
                          for g in range(8)}
                assert len(groups) == 8


def test_plan_fits_and_chooses_a_width_and_splits():
    for bn in pg.GW_WIDTHS:
        assert pg.smem_bytes(bn) <= 227 * 1024
        assert pg.stage_bytes(bn) % 1024 == 0
    # a short prompt on the widest matrix: enough tiles, no split; a long one: the widest tile
    assert pg.choose_plan(4096, 37888, 3584, 132) == (256, 1)
    # a short prompt on a narrow matrix with a long K (the 7B's down at T = 512: 56 tiles of n256): split
    assert pg.choose_plan(512, 3584, 18944, 132)[1] > 1
    for t in (1, 17, 511, 513, 4096):
        for n, k in ((512, 256), (3584, 3584), (4608, 3584), (37888, 3584), (3584, 18944), (136, 384)):
            bn, s = pg.choose_plan(t, n, k, 132)
            gx, gy, gz = pg.grid(t, n, bn, s)
            assert gx * bn >= t and gy * pg.GW_ROWS >= n and gz == s
            assert s == 1 or (k // 128 >= 2 * s and s * t * n * 4 <= pg.WORKSPACE_CAP)


def test_split_k_ranges_cover_k_once_in_pairs_of_stages():
    """The kernel's split z takes groups [z G / S, (z + 1) G / S): every group once, none empty."""
    for g in (2, 3, 12, 28, 70, 148):
        for s in pg.GW_SPLITS:
            if s > 1 and g < 2 * s:
                continue
            ranges = [(z * g // s, (z + 1) * g // s) for z in range(s)]
            assert [lo for lo, _ in ranges[1:]] == [hi for _, hi in ranges[:-1]]
            assert ranges[0][0] == 0 and ranges[-1][1] == g and all(hi > lo for lo, hi in ranges)
