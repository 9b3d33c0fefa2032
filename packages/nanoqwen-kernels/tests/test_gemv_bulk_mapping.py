"""CPU check of gemv_bulk.cuh's data flow (the bulk-copy GEMV, B = 1): a numpy emulation of what the
producer warp copies into a ring stage (row slots at their stride, the slice's scales) and of what each
consumer lane reads back from it into mma.sync m16n8k16 (test_gemv_mma_mapping.py's fragment emulation),
through the warps' groups, the scales and the tile's warp-ordered sums, for the three row maps. Also the
stage's bank layout, the blocks' tile ranges, the ring's parities and the launcher's plan."""

import numpy as np
import pytest
from nanoqwen_kernels.dims import PRESETS, ModelDims
from nanoqwen_kernels.errors import KernelError
from nanoqwen_kernels.gemv import (
    BULK_GROUPS,
    BULK_MAX_STAGES,
    BULK_ROWS,
    BULK_SMEM_CAP,
    BULK_WARPS,
    bulk_stage_bytes,
    plan_bulk,
)
from refs import dequant, pack_valueshuffle, random_int4
from test_gemv_mma_mapping import mma16816, unpack8, xs_slot

GROUP = 128
STRIDE = 64 * (BULK_GROUPS | 1)  # gemv_bulk.cuh kBulkRowStride
STAGE_W = BULK_ROWS * STRIDE


def plain_rows(n):
    return lambda p: (2 * p, min(2 * p + 1, n - 1))


def qkv_rows(p):
    r0 = (p // 64) * 128 + p % 64
    return r0, r0 + 64


def gate_up_rows(inter):
    return lambda p: (p, inter + p)


def produce(words, scales, tile, s, units, rows_of):
    """The producer warp's stage (tile, slice s) as bytes: W slots then S (gemv_bulk.cuh bulk_produce)."""
    kg = scales.shape[1]
    g_lo = s * BULK_GROUPS
    ng = min(BULK_GROUPS, kg - g_lo)
    stage = np.full(STAGE_W + BULK_ROWS * BULK_GROUPS * 2, 0xAB, dtype=np.uint8)  # poison
    wbytes = words.view(np.uint8).reshape(words.shape[0], -1)
    sbytes = scales.view(np.uint8).reshape(scales.shape[0], -1)
    for lane in range(BULK_ROWS):
        r0, r1 = rows_of(min(8 * tile + (lane & 7), units - 1))
        row = r0 if lane < 8 else r1
        stage[lane * STRIDE : lane * STRIDE + 64 * ng] = wbytes[row, 64 * g_lo : 64 * (g_lo + ng)]
        so = STAGE_W + lane * BULK_GROUPS * 2
        stage[so : so + 2 * ng] = sbytes[row, 2 * g_lo : 2 * (g_lo + ng)]
    return stage, g_lo, ng


def consume_tile(words, scales, x, tile, units, rows_of):
    """The consumer warps over one tile: sums[unit, 2] as the epilogue receives them."""
    kg = scales.shape[1]
    slices = -(-kg // BULK_GROUPS)
    xs = np.zeros((x.size // 8, 8))
    for i in range(x.size // 8):
        xs[xs_slot(i)] = x[8 * i : 8 * i + 8]
    acc = np.zeros((BULK_WARPS, 32, 2))
    for s in range(slices):
        stage, g_lo, ng = produce(words, scales, tile, s, units, rows_of)
        sv = stage[STAGE_W:].view(np.float16)
        for w in range(BULK_WARPS):
            for gi in range(w, ng, BULK_WARPS):
                lanes_w0, lanes_w1 = [], []
                for ln in range(32):
                    g, c = ln // 4, ln % 4
                    o0 = g * STRIDE + gi * 64 + c * 16
                    o1 = (g + 8) * STRIDE + gi * 64 + c * 16
                    lanes_w0.append(stage[o0 : o0 + 16].view(np.uint32))
                    lanes_w1.append(stage[o1 : o1 + 16].view(np.uint32))
                d = np.zeros((32, 4))
                gl = g_lo + gi
                for wd in range(4):
                    q0 = [unpack8(int(lanes_w0[ln][wd])) for ln in range(32)]
                    q1 = [unpack8(int(lanes_w1[ln][wd])) for ln in range(32)]
                    xv = [xs[xs_slot(gl * 16 + 4 * (ln % 4) + wd)] if ln // 4 == 0 else np.zeros(8) for ln in range(32)]
                    a = [(q0[ln][0], q1[ln][0], q0[ln][1], q1[ln][1]) for ln in range(32)]
                    b = [((xv[ln][0], xv[ln][1]), (xv[ln][2], xv[ln][3])) for ln in range(32)]
                    d += np.array(mma16816(a, b))
                    a = [(q0[ln][2], q1[ln][2], q0[ln][3], q1[ln][3]) for ln in range(32)]
                    b = [((xv[ln][4], xv[ln][5]), (xv[ln][6], xv[ln][7])) for ln in range(32)]
                    d += np.array(mma16816(a, b))
                for ln in range(32):
                    g = ln // 4
                    acc[w, ln, 0] += d[ln, 0] * float(sv[g * BULK_GROUPS + gi])
                    acc[w, ln, 1] += d[ln, 2] * float(sv[(g + 8) * BULK_GROUPS + gi])
    sums = np.zeros((8, 2))
    for u in range(8):  # lanes 4u (c = 0) hold unit u's rows; added in warp order
        sums[u] = acc[:, 4 * u, :].sum(axis=0)
    return sums


@pytest.mark.parametrize(
    "case", ["plain_even", "plain_odd_rows", "qkv", "gate_up", "long_k_odd_groups"]
)
def test_bulk_stage_flow_gives_every_units_dot_products(rng, case):
    if case == "plain_even":
        n, k = 48, 3 * BULK_GROUPS * GROUP // 2  # 24 groups: a full and a partial slice
        rows_of, units = plain_rows(n), n // 2
    elif case == "plain_odd_rows":
        n, k = 37, 2 * GROUP  # a tail tile with a repeated unit and a single-row last unit
        rows_of, units = plain_rows(n), (n + 1) // 2
    elif case == "qkv":
        n, k = 4 * 128, 4 * GROUP  # 4 "heads"
        rows_of, units = qkv_rows, n // 2
    elif case == "gate_up":
        inter = 24
        n, k = 2 * inter, 2 * GROUP
        rows_of, units = gate_up_rows(inter), inter
    else:  # K of an odd group count over three slices (the test dims' path)
        n, k = 16, (2 * BULK_GROUPS + 3) * GROUP
        rows_of, units = plain_rows(n), n // 2
    u, s = random_int4(rng, n, k)
    words = pack_valueshuffle(u)
    x = rng.standard_normal(k).astype(np.float16).astype(np.float64)
    ref = dequant(u, s) @ x
    tiles = -(-units // 8)
    for t in range(tiles):
        sums = consume_tile(words, s, x, t, units, rows_of)
        for i in range(8):
            p = 8 * t + i
            if p >= units:
                continue
            r0, r1 = rows_of(p)
            np.testing.assert_allclose(sums[i], [ref[r0], ref[r1]], rtol=1e-9, atol=1e-9,
                                       err_msg=f"{case} tile {t} unit {p}")


def test_bulk_stage_reads_are_bank_conflict_free():
    """Each quarter-warp (8 lanes) of a 16-byte shared-memory read must touch 8 distinct 16-byte bank
    groups: the weight reads of rows g and g + 8 at every group of a stage, and the x reads of lanes 0..3."""
    for gi in range(BULK_GROUPS):
        for row_off in (0, 8):
            offs = [((ln // 4) + row_off) * STRIDE + gi * 64 + (ln % 4) * 16 for ln in range(32)]
            for q in range(4):
                groups = {(o % 128) // 16 for o in offs[8 * q : 8 * q + 8]}
                assert len(groups) == 8, f"group {gi} rows +{row_off}: quarter {q} conflicts"
    for gl in range(64):
        for wd in range(4):
            chunks = [xs_slot(gl * 16 + 4 * c + wd) for c in range(4)]
            assert len({(16 * ch % 128) // 16 for ch in chunks}) == 4


@pytest.mark.parametrize("tiles,blocks", [(2368, 132), (288, 132), (224, 132), (5, 5), (7, 3)])
def test_bulk_blocks_cover_every_tile_once(tiles, blocks):
    seen = np.zeros(tiles, dtype=int)
    for b in range(blocks):
        lo, hi = b * tiles // blocks, (b + 1) * tiles // blocks
        assert hi - lo >= tiles // blocks
        seen[lo:hi] += 1
    assert (seen == 1).all()


@pytest.mark.parametrize("n_stages,stages_total", [(2, 9), (12, 36), (10, 5)])
def test_bulk_ring_parities_hand_each_stage_over_once(n_stages, stages_total):
    """Replay the ring's mbarrier phases (bulk_produce / gemv_bulk): the producer may fill stage j only once
    the consumers have completed empty[j % n]'s phase (j / n - 1), and the consumers read stage j at full's
    phase j / n. Interleaving greedily, every stage is consumed exactly once, after it was filled, and a slot
    is never refilled before its previous stage was consumed."""
    full_done = [0] * n_stages  # phases completed per slot
    empty_done = [0] * n_stages
    slot_data = [None] * n_stages
    produced = consumed = 0
    order = []
    while consumed < stages_total:
        j = produced
        if produced < stages_total and (j < n_stages or empty_done[j % n_stages] >= j // n_stages):
            assert slot_data[j % n_stages] is None
            slot_data[j % n_stages] = j
            full_done[j % n_stages] += 1
            produced += 1
            continue
        j = consumed
        assert full_done[j % n_stages] >= j // n_stages + 1, "consumer would wait forever"
        assert slot_data[j % n_stages] == j
        order.append(j)
        slot_data[j % n_stages] = None
        empty_done[j % n_stages] += 1
        consumed += 1
    assert order == list(range(stages_total))


@pytest.mark.parametrize("preset", ["7b", "1.5b", "tiny"])
def test_plan_bulk_fits_shared_memory(preset):
    d = PRESETS[preset]
    for k, units in ((d.hidden, d.qkv_rows // 2), (d.hidden, d.intermediate), (d.intermediate, d.hidden // 2)):
        plan = plan_bulk(k, units, 132)
        assert 2 <= plan.stages <= BULK_MAX_STAGES
        assert plan.smem == 2 * k + plan.stages * bulk_stage_bytes() <= BULK_SMEM_CAP
        assert plan.blocks == min(132, -(-units // 8))
    assert bulk_stage_bytes() == STAGE_W + BULK_ROWS * BULK_GROUPS * 2
    with pytest.raises(KernelError):
        plan_bulk(100, 8, 132)


def test_plan_bulk_refuses_a_k_with_no_room_for_a_ring():
    with pytest.raises(KernelError, match="ring"):
        plan_bulk(GROUP * 880, 8, 132)
    odd = ModelDims(hidden=384, intermediate=640, n_heads=2, n_kv_heads=1, head_dim=128, vocab=1000,
                    n_layers=1, rope_theta=1e6)
    assert plan_bulk(odd.intermediate, 192, 132).blocks == 24
