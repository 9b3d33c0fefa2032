"""CPU check of the tile GEMM's wgmma build (gemm_tiles.cuh, wgmma.cuh): a numpy emulation of
wgmma.mma_async m64nNk16 with A from registers and B through a 128-byte-swizzled K-major descriptor, fed
exactly as the kernel feeds it: x in its swizzled places (x_places, the layout's definition; issue_x's
4-byte copies and nq_norm_cols_wg_h's stores must both land there), multiply_pair's A
fragments (a lane's four words of a group, two k16 steps per word) and its descriptor start per step. The
product over a 256-k pair must be every row's dot product with every column. Catches a wrong copy offset,
swizzle, step order or k pairing between A and B before any GPU run; also that the copies cover each x
once and that the 32 lanes of a copy write 32 different banks."""

import numpy as np
import pytest

TILE_UNITS, TILE_WARPS, PAIR_K = 128, 16, 256


def x_places(x: np.ndarray, ncols: int, n_cols_build: int, pg: int):
    """The stage's x layout (gemm_tiles.cuh), as the kernel's first version copied it (one warp per (column,
    quarter) item): yields (warp, item, lane, byte offset in the stage's x, column, k)."""
    k_total = x.shape[1]
    for warp in range(TILE_WARPS):
        for item in range(warp, ncols * 4, TILE_WARPS):
            n, qq = item >> 2, item & 3
            for lane in range(32):
                c, q = lane >> 3, lane & 7
                k = 256 * pg + 128 * (qq >> 1) + 32 * c + 8 * (2 * (qq & 1) + (q >> 2)) + 2 * (q & 3)
                off = (qq * (n_cols_build // 8) + (n >> 3)) * 1024 + (n & 7) * 128 + ((q ^ (n & 7)) << 4) + 4 * c
                if k < k_total:
                    yield warp, item, lane, off, n, k


def stage_x(x: np.ndarray, ncols: int, n_cols_build: int, pg: int) -> np.ndarray:
    """The stage's x region as fp64 halves (NaN where no copy wrote: a read of it poisons the product)."""
    smem = np.full(n_cols_build * PAIR_K, np.nan)
    written = np.zeros(n_cols_build * PAIR_K, dtype=int)
    for _, _, _, off, n, k in x_places(x, ncols, n_cols_build, pg):
        assert off % 4 == 0
        smem[off // 2], smem[off // 2 + 1] = x[n, k], x[n, k + 1]
        written[off // 2] += 1
        written[off // 2 + 1] += 1
    assert written.max() <= 1, "two copies wrote one place"
    return smem


def read_b(smem: np.ndarray, start: int, n_cols_build: int) -> np.ndarray:
    """B (16 x N) as the tensor cores read it: K-major rows of 128 bytes, 8 rows an atom, the next 8
    columns one SBO (1024 bytes) on, the 16-byte chunk index XORed with address bits 7-9."""
    b = np.zeros((16, n_cols_build))
    for n in range(n_cols_build):
        for kk in range(16):
            o = start + (n >> 3) * 1024 + (n & 7) * 128 + 2 * kk
            o ^= ((o >> 7) & 7) << 4
            b[kk, n] = smem[o // 2]
    return b


def a_fragments(w: np.ndarray, warp_in_wg: int, gl: int, wd: int, h: int) -> np.ndarray:
    """A (16 x 16 rows of this warp) of step 2 wd + h of group gl, as multiply_pair builds its registers:
    lane (g, c) unpacks words wd of its chunk c (k = 128 gl + 32 c + 8 wd ..) of rows r0 (fragment row g)
    and r1 (row g + 8); half2 2h goes to slots 2c, 2c+1 and half2 2h+1 to slots 2c+8, 2c+9."""
    a = np.zeros((16, 16))
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        k0 = 128 * gl + 32 * c + 8 * wd + 4 * h
        for frag_row, row in ((g, 16 * warp_in_wg + g), (g + 8, 16 * warp_in_wg + g + 8)):
            a[frag_row, 2 * c], a[frag_row, 2 * c + 1] = w[row, k0], w[row, k0 + 1]
            a[frag_row, 2 * c + 8], a[frag_row, 2 * c + 9] = w[row, k0 + 2], w[row, k0 + 3]
    return a


@pytest.mark.parametrize("nt,ncols", [(1, 8), (1, 3), (2, 11), (4, 32), (8, 64), (8, 37)])
def test_wgmma_pair_gives_the_dot_products(nt, ncols):
    rng = np.random.default_rng()
    n_build = 8 * nt
    k_total = 2 * PAIR_K
    pg = int(rng.integers(0, 2))
    w = rng.integers(-8, 8, size=(64, k_total)).astype(np.float64)  # a warpgroup's 64 rows (q values)
    x = rng.standard_normal((ncols, k_total))
    smem = stage_x(x, ncols, n_build, pg)
    d = np.zeros((64, n_build))
    for gl in range(2):
        for wd in range(4):
            for h in range(2):
                st = 8 * gl + 2 * wd + h
                start = (st >> 2) * (nt * 1024) + (st & 3) * 32
                b = read_b(smem, start, n_build)
                a = np.vstack([a_fragments(w[:, 256 * pg:], wq, gl, wd, h) for wq in range(4)])
                d += a @ b
    want = w[:, 256 * pg:256 * (pg + 1)] @ x[:, 256 * pg:256 * (pg + 1)].T
    np.testing.assert_allclose(d[:, :ncols], want, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("ncols", [1, 5, 8, 64])
def test_wgmma_x_copies_cover_once_and_spread_banks(ncols):
    n_build = max(8, -(-ncols // 8) * 8)
    x = np.zeros((ncols, PAIR_K))
    seen: dict[tuple[int, int], int] = {}
    banks: dict[tuple[int, int], set[int]] = {}
    for warp, item, _lane, off, n, k in x_places(x, ncols, n_build, 0):
        seen[(n, k)] = seen.get((n, k), 0) + 1
        banks.setdefault((warp, item), set()).add((off // 4) % 32)
    assert seen == {(n, k): 1 for n in range(ncols) for k in range(0, PAIR_K, 2)}
    assert all(len(b) == 32 for b in banks.values()), "a copy instruction's lanes share a bank"


def issue_x(x: np.ndarray, ncols: int, n_cols_build: int, pg: int, warps: int):
    """issue_x (o_proj and down): yields (warp, (quarter, column), lane, offset, column, k)."""
    k_total = x.shape[1]
    for warp in range(warps):
        for qq in range(warp, 4, warps):
            k0 = 256 * pg + 128 * (qq >> 1)
            if k0 >= k_total:
                continue
            for lane in range(32):
                c, q = lane >> 3, lane & 7
                klane = 32 * c + 8 * (q >> 2) + 2 * (q & 3)
                dst = qq * (n_cols_build // 8) * 1024 + 4 * c
                for n8 in range(-(-ncols // 8)):
                    for r in range(8):
                        n = 8 * n8 + r
                        if n < ncols:
                            yield warp, (qq, n), lane, dst + n8 * 1024 + r * 128 + ((q ^ r) << 4), n, k0 + 16 * (qq & 1) + klane


@pytest.mark.parametrize("ncols,warps", [(1, 4), (5, 4), (8, 4), (37, 4), (64, 4), (64, 2), (9, 1)])
def test_issue_x_makes_the_layouts_copies(ncols, warps):
    """issue_x's copy order puts every (column, k) pair at its place in the layout, once, and each copy
    instruction's 32 lanes still write 32 different banks."""
    n_build = max(8, -(-ncols // 8) * 8)
    for k_total, pg in ((PAIR_K, 0), (2 * PAIR_K, 1), (PAIR_K + 128, 1)):  # the last: an odd group count
        x = np.zeros((ncols, k_total))
        want = {(n, k): off for _, _, _, off, n, k in x_places(x, ncols, n_build, pg)}
        got: dict[tuple[int, int], int] = {}
        banks: dict[tuple, set[int]] = {}
        for warp, item, _lane, off, n, k in issue_x(x, ncols, n_build, pg, warps):
            assert (n, k) not in got, "copied twice"
            got[(n, k)] = off
            banks.setdefault((warp, item), set()).add((off // 4) % 32)
        assert got == want
        assert all(len(b) == 32 for b in banks.values())


def norm_cols_wg_offset(n: int, k: int, tile_cols: int) -> int:
    """Byte offset norm_cols<K, true> (gemv_mma.cuh) writes the half2 (k, k+1) of column n at (k even)."""
    i, j = k // 8, (k % 8) // 2
    kk = 8 * i
    pg, gl, c, w = kk >> 8, (kk >> 7) & 1, (kk >> 5) & 3, (kk >> 3) & 3
    qq, r = 2 * gl + (w >> 1), n & 7
    atom = pg * tile_cols * 512 + (qq * (tile_cols // 8) + (n >> 3)) * 1024 + r * 128 + 4 * c
    return atom + (((4 * (w & 1) + j) ^ r) << 4)


def issue_x_pre_chunks(ncols: int, n_cols_build: int, k_total: int, pg: int, warps: int = 4) -> set[int]:
    """Stage byte offsets of the 16-byte chunks issue_x_pre copies (the same offset in pair pg's block)."""
    chunks = -(-ncols // 8) * 64
    out = set()
    for warp in range(warps):
        for qq in range(warp, 4, warps):
            if 256 * pg + 128 * (qq >> 1) >= k_total:
                continue
            q0 = qq * (n_cols_build // 8) * 1024
            for lane in range(32):
                out.update(q0 + 16 * ch for ch in range(lane, chunks, 32))
    return out


@pytest.mark.parametrize("ncols", [1, 5, 8, 9, 37, 64])
def test_preperm_x_lands_where_the_copies_expect_it(ncols):
    """NQ_TILE_X_PREPERM: the RMSNorm writes each column's x at its place in the stage layout, within its
    pair's block, and issue_x_pre's 16-byte chunks cover every one of those places (and
    stay inside the buffer the launcher passes: build x K halves)."""
    n_build = max(8, -(-ncols // 8) * 8)
    for k_total in (PAIR_K, 3 * PAIR_K, 3 * PAIR_K + 128):  # the last: an odd group count
        x = np.zeros((ncols, k_total))
        pairs = -(-k_total // PAIR_K)
        want = {}
        for pg in range(pairs):
            want.update({(n, k): pg * n_build * 512 + off for _, _, _, off, n, k in x_places(x, ncols, n_build, pg)})
        got = {(n, k): norm_cols_wg_offset(n, k, n_build) for n in range(ncols) for k in range(0, k_total, 2)}
        assert got == want
        assert max(got.values()) + 4 <= n_build * k_total * 2
        for pg in range(pairs):
            copied = issue_x_pre_chunks(ncols, n_build, k_total, pg)
            assert all(p + 16 <= n_build * k_total * 2 - pg * n_build * 512 for p in copied)
            for (n, k), off in got.items():
                if k // PAIR_K == pg:
                    assert (off - pg * n_build * 512) // 16 * 16 in copied, (n, k)


# ---- attention_prefill.cu: S = Q K^T and O += P V with K and V tiles in the same swizzled bytes --------------

def attn_tile_offset(n: int, c: int) -> int:
    """nq_pre_wg::tile_offset: the byte where key n's dims 8c .. 8c+7 land in a K or V tile (c = 0..15)."""
    return 8192 * (c >> 3) + 1024 * (n >> 3) + 128 * (n & 7) + 16 * ((c & 7) ^ (n & 7))


def attn_tile(x: np.ndarray) -> np.ndarray:
    """A [64 keys, 128 dims] K or V tile as the kernel's cp.async copies lay it out (fp64 halves)."""
    smem = np.full(16384 // 2, np.nan)
    for n in range(64):
        for c in range(16):
            o = attn_tile_offset(n, c) // 2
            smem[o:o + 8] = x[n, 8 * c:8 * c + 8]
    return smem


def read_b_mn(smem: np.ndarray, start: int, lbo: int) -> np.ndarray:
    """B (16 k x 128 n) of an MN-major, 128-byte-swizzled descriptor (imm-trans-b): n 0..63 of k row r at
    start + 1024 (r / 8) + 128 (r % 8) (SBO 1024 between 8-row groups), n 64..127 LBO bytes on; the
    16-byte chunk index XORed with address bits 7-9, as for K-major."""
    b = np.zeros((16, 128))
    for k in range(16):
        for n in range(128):
            o = start + (n >> 6) * lbo + (k >> 3) * 1024 + (k & 7) * 128 + 2 * (n & 63)
            o ^= ((o >> 7) & 7) << 4
            b[k, n] = smem[o // 2]
    return b


def test_attention_tile_places_every_value_once_in_16_byte_pieces():
    offs = {attn_tile_offset(n, c) for n in range(64) for c in range(16)}
    assert len(offs) == 64 * 16 and all(o % 16 == 0 and 0 <= o < 16384 for o in offs)
    # the 8 threads copying one key's chunks 0..7 (or 8..15) write 8 different 16-byte bank groups
    for n in range(64):
        for half in (0, 8):
            assert len({(attn_tile_offset(n, c) >> 4) & 7 for c in range(half, half + 8)}) == 8


def test_attention_scores_are_q_times_k():
    """The 8 wgmma m64n64k16 per tile (A = each warp's Q fragments of dim step kk, B K-major from the K
    tile at 8192 (kk / 4) + 32 (kk % 4) bytes) give S = Q K^T for all 64 query rows and 64 keys."""
    rng = np.random.default_rng()
    q, k = rng.standard_normal((64, 128)), rng.standard_normal((64, 128))
    smem = attn_tile(k)
    s = np.zeros((64, 64))
    for kk in range(8):
        b = read_b(smem, 8192 * (kk >> 2) + 32 * (kk & 3), 64)  # 16 dims x 64 keys
        s += q[:, 16 * kk:16 * kk + 16] @ b
    np.testing.assert_allclose(s, q @ k.T, rtol=1e-12, atol=1e-12)


def test_attention_pv_is_p_times_v():
    """The 4 wgmma m64n128k16 per tile (A = P's fragments of key step kk, B MN-major from the V tile at
    2048 kk bytes, LBO 8192) give O = P V for all 64 rows and 128 dims."""
    rng = np.random.default_rng()
    p, v = rng.random((64, 64)), rng.standard_normal((64, 128))
    smem = attn_tile(v)
    o = np.zeros((64, 128))
    for kk in range(4):
        o += p[:, 16 * kk:16 * kk + 16] @ read_b_mn(smem, 2048 * kk, 8192)
    np.testing.assert_allclose(o, p @ v, rtol=1e-12, atol=1e-12)
