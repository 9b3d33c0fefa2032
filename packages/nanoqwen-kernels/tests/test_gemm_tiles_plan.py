"""CPU: the tile GEMM's stripes (tile_plan.py plan_tiles, gemm_tiles.cuh gemm_tiles) as the kernel walks them.

The kernel's bookkeeping is mirrored here line for line: each block's segments, the ws slot a partial
segment writes (2 b for the block's first segment, 2 b + 1 for its last), the contributors a tile's last
block counts (stripe_of of the tile's first and last item) and the slot it reads for each. Checked for
the 7B, 1.5B, tiny and odd shapes at several SM counts: every (tile, pair) item is computed exactly once,
whole tiles go straight to the epilogue, every partial tile is reduced from exactly the slots its
segments wrote, no slot is written twice in one launch, and the plan does not depend on B."""

import pytest
from nanoqwen_kernels.dims import PRESETS
from nanoqwen_kernels.tile_plan import TILE_UNITS, plan_tiles, tile_smem, tile_stages


def stripe_of(j: int, items: int, p: int) -> int:
    return ((j + 1) * p - 1) // items


def walk(plan):
    """(direct tiles, {tile: [(block, slot, pairs)]} written, {tile: [slot]} the reducer reads)."""
    direct, written = [], {}
    covered = [0] * plan.items
    for b in range(plan.blocks):
        lo, hi = plan.stripe(b)
        j = lo
        while j < hi:
            t, p0 = divmod(j, plan.pairs)
            p1 = min(plan.pairs, p0 + (hi - j))
            first = j == lo
            for q in range(p0, p1):
                covered[t * plan.pairs + q] += 1
            j += p1 - p0
            if p0 == 0 and p1 == plan.pairs:
                direct.append(t)
            else:
                written.setdefault(t, []).append((b, 2 * b + (0 if first else 1), p1 - p0))
    assert covered == [1] * plan.items
    reads = {}
    for t in written:
        item0 = t * plan.pairs
        b_first, b_last = stripe_of(item0, plan.items, plan.blocks), stripe_of(item0 + plan.pairs - 1, plan.items, plan.blocks)
        slots = []
        for b in range(b_first, b_last + 1):
            tb = plan.stripe(b)[0] // plan.pairs
            slots.append(2 * b + (0 if tb == t else 1))
        reads[t] = slots
    return direct, written, reads


def shapes():
    out = []
    for name, d in sorted(PRESETS.items()):
        out += [(f"{name}-qkv", d.hidden, d.qkv_rows // 2), (f"{name}-o", d.hidden, (d.hidden + 1) // 2),
                (f"{name}-gu", d.hidden, d.intermediate), (f"{name}-down", d.intermediate, (d.hidden + 1) // 2)]
    out += [("odd-3groups", 384, 193), ("odd-7groups", 896, 4864), ("one-tile", 128, 1)]
    return out


@pytest.mark.parametrize("sms", [1, 7, 78, 132, 1000])
@pytest.mark.parametrize("name,k,units", shapes())
def test_stripes_cover_every_item_once_and_reduce_what_they_wrote(name, k, units, sms):
    plan = plan_tiles(k, units, sms)
    assert plan.tiles == -(-units // TILE_UNITS) and 1 <= plan.blocks <= min(sms, plan.items)
    direct, written, reads = walk(plan)
    assert set(direct).isdisjoint(written) and set(direct) | set(written) == set(range(plan.tiles))
    slots = [s for segs in written.values() for _, s, _ in segs]
    assert len(slots) == len(set(slots)) and all(0 <= s < 2 * plan.blocks for s in slots)
    for t, segs in written.items():
        assert len(segs) >= 2, f"tile {t}: a partial tile has at least two segments"
        assert reads[t] == [s for _, s, _ in segs], f"tile {t}: the reducer reads other slots than were written"
        assert [b for b, _, _ in segs] == list(range(segs[0][0], segs[-1][0] + 1))
        assert sum(n for _, _, n in segs) == plan.pairs


def test_plan_is_a_function_of_the_matrix_only():
    """No B in the plan: the reduction order (and so every bit of a row) is the same at every batch."""
    d = PRESETS["7b"]
    a = plan_tiles(d.intermediate, d.hidden // 2, 132)
    assert a == plan_tiles(d.intermediate, d.hidden // 2, 132)
    assert a.tiles == 14 and a.pairs == 74 and a.blocks == 132


@pytest.mark.parametrize("knobs,stages", [("", [5, 5, 4, 3]), ("NQ_TILE_STAGES=4", [4, 4, 4, 3]),
                                          ("NQ_TILE_STAGES=2", [2, 2, 2, 2])])
def test_shared_memory_fits_one_block_per_sm(knobs, stages, monkeypatch):
    """Every build's ring (stages of 256 rows x 256 k of INT4 + their scales + x of its columns, and 1 KB to
    align it) stays under Hopper's 227 KB per block with the kernel's static shared memory (~1 KB: the
    ticket flag and the mbarriers): as many stages as fit, up to NQ_TILE_STAGES (default 8)."""
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", knobs)
    assert [tile_stages(c) for c in (8, 16, 32, 64)] == stages
    for c in (8, 16, 32, 64):
        assert tile_smem(c) + 1040 <= 227 * 1024


@pytest.mark.parametrize("value,blocks", [("", 98), ("2", 98), ("4", 49), ("200", 1)])
def test_min_items_knob_sets_the_block_count(value, blocks, monkeypatch):
    """$NANOQWEN_TILE_MIN_ITEMS (an A/B knob): 7B o_proj has 14 tiles x 14 pairs = 196 items; the stripes
    stay a valid cover at any setting (checked by the walk above for the default)."""
    from nanoqwen_kernels.errors import KernelError

    monkeypatch.setenv("NANOQWEN_TILE_MIN_ITEMS", value)
    d = PRESETS["7b"]
    plan = plan_tiles(d.hidden, d.hidden // 2, 132)
    assert plan.blocks == blocks
    direct, written, reads = walk(plan)
    assert set(direct) | set(written) == set(range(plan.tiles))
    for t, segs in written.items():
        assert reads[t] == [s for _, s, _ in segs] and sum(n for _, _, n in segs) == plan.pairs
    for bad in ("0", "x", "-3"):
        monkeypatch.setenv("NANOQWEN_TILE_MIN_ITEMS", bad)
        with pytest.raises(KernelError, match="NANOQWEN_TILE_MIN_ITEMS"):
            plan_tiles(d.hidden, d.hidden // 2, 132)
