"""CPU: the tile GEMM's cp.async ring (gemm_tiles.cuh), both loops, as the block's threads run them.

The GPU tests check the results; this checks the ordering the results rest on, for every stage count and
shape, in CI. Each loop is written out here as the program order every thread of a block follows (the
kernel's loops are block-uniform): copy issues, commits, waits, barriers, multiplies, segment ends. The
checker then applies cp.async's rules (a commit closes the thread's issued copies into a group; wait<N>
returns once all but the N most recent groups have landed; a barrier makes every thread's landed copies
visible to all) and asserts:
- a step's multiply reads its own stage: its weights and x landed by a wait that a barrier follows, and
  no later step's copies were issued into that slot before it;
- a slot is refilled only after a barrier that follows the multiply of the step it held;
- x is never copied before pdl_wait (weights may be: the continuous loop issues stage 0's early);
- every step of the stripe is issued and multiplied once, in order, with the pair and tile the stripe
  gives it (its weights copied from that tile's rows), and each segment ends once with its pairs;
- nothing is in flight when the block exits.
"""

import pytest
from nanoqwen_kernels.dims import PRESETS
from nanoqwen_kernels.gemv import plan_tiles


def continuous(lo: int, n: int, pairs: int, stages: int, early_w: bool) -> list[tuple]:
    """gemm_tiles (the 8- and 32-column builds), line for line."""
    ops: list[tuple] = []
    rows_t = lo // pairs  # the tile whose copy rows the thread holds (copy_rows)
    if early_w and n > 0:
        ops.append(("issue_w", 0, rows_t))
    ops.append(("pdl_wait",))
    for i in range(stages - 1):
        if i < n:
            if i > 0 and (lo + i) % pairs == 0:
                rows_t = (lo + i) // pairs
            if not early_w or i > 0:
                ops.append(("issue_w", i, rows_t))
            ops.append(("issue_x", i))
        ops.append(("commit",))
    i = 0
    while i < n:
        t = (lo + i) // pairs
        p0 = lo + i - t * pairs
        seg_end = min(n, i + pairs - p0)
        i0, n_seg = i, seg_end - i
        for s in range(n_seg):
            ii = i0 + s
            ops += [("wait", stages - 2), ("sync",)]
            if ii + stages - 1 < n:
                ops += [("issue_w", ii + stages - 1, (lo + ii + stages - 1) // pairs), ("issue_x", ii + stages - 1)]
            ops.append(("commit",))
            ops.append(("multiply", ii, p0 + s, t))
        i = seg_end
        ops.append(("segment_done", t, p0, p0 + n_seg))
    ops.append(("wait", 0))
    return ops


def drained(lo: int, n: int, pairs: int, stages: int) -> list[tuple]:
    """gemm_tiles_drained (the 16- and 64-column builds), line for line."""
    ops: list[tuple] = [("pdl_wait",)]
    j = lo
    while j < lo + n:
        t = j // pairs
        p0 = j - t * pairs
        p1 = min(pairs, p0 + (lo + n - j))
        i0 = j - lo
        j += p1 - p0
        n_seg = p1 - p0
        for i in range(stages - 1):
            if i < n_seg:
                ops += [("issue_w", i0 + i, t), ("issue_x", i0 + i)]
            ops.append(("commit",))
        for i in range(n_seg):
            ops += [("wait", stages - 2), ("sync",)]
            if i + stages - 1 < n_seg:
                ops += [("issue_w", i0 + i + stages - 1, t), ("issue_x", i0 + i + stages - 1)]
            ops.append(("commit",))
            ops.append(("multiply", i0 + i, p0 + i, t))
        ops += [("wait", 0), ("sync",)]
        ops.append(("segment_done", t, p0, p1))
    return ops


def check(ops: list[tuple], lo: int, n: int, pairs: int, stages: int) -> None:
    open_copies: list[tuple] = []  # issued, not yet committed
    groups: list[list[tuple]] = []
    landed: set = set()  # copies complete in this thread's view
    visible: set = set()  # landed before the last barrier: every thread's copies are in
    owner: dict[int, int] = {}  # slot -> the step whose copies were last issued into it
    done_before_sync: set = set()  # steps multiplied before the last barrier
    multiplied: list[int] = []
    pending_multiplied: list[int] = []
    waited = False
    issued = {"w": [], "x": []}
    segments = []
    for op in ops:
        kind = op[0]
        if kind == "pdl_wait":
            waited = True
        elif kind in ("issue_w", "issue_x"):
            step = op[1]
            part = kind[-1]
            assert 0 <= step < n, op
            if part == "x":
                assert waited, f"x of step {step} copied before pdl_wait"
            else:
                assert op[2] == (lo + step) // pairs, f"step {step}'s weights copied with tile {op[2]}'s rows"
            slot = step % stages
            prev = owner.get(slot)
            if prev is not None and prev != step:
                assert prev in done_before_sync, f"slot {slot} refilled for step {step} before step {prev}'s multiply and a barrier"
            owner[slot] = step
            issued[part].append(step)
            open_copies.append((part, step))
        elif kind == "commit":
            groups.append(open_copies)
            open_copies = []
        elif kind == "wait":
            for g in groups[: max(0, len(groups) - op[1])]:
                landed.update(g)
        elif kind == "sync":
            visible = set(landed)
            done_before_sync.update(pending_multiplied)
            pending_multiplied = []
        elif kind == "multiply":
            step, pg, t = op[1:]
            assert owner[step % stages] == step, f"step {step}'s slot holds step {owner[step % stages]}"
            assert ("w", step) in visible and ("x", step) in visible, f"step {step} multiplied before its copies landed"
            assert (pg, t) == ((lo + step) % pairs, (lo + step) // pairs)
            multiplied.append(step)
            pending_multiplied.append(step)
        elif kind == "segment_done":
            segments.append(op[1:])
    assert not open_copies and all(c in landed for g in groups for c in g), "copies in flight at exit"
    assert multiplied == list(range(n))
    assert sorted(issued["w"]) == sorted(issued["x"]) == list(range(n))
    # the segments: each tile's run of steps, in order, with its pairs
    want, i = [], 0
    while i < n:
        t, p0 = divmod(lo + i, pairs)
        k = min(n - i, pairs - p0)
        want.append((t, p0, p0 + k))
        i += k
    assert segments == want


def stripes():
    out = []
    for name, d in sorted(PRESETS.items()):
        for label, k, units in ((f"{name}-o", d.hidden, (d.hidden + 1) // 2), (f"{name}-gu", d.hidden, d.intermediate),
                                (f"{name}-down", d.intermediate, (d.hidden + 1) // 2)):
            plan = plan_tiles(k, units, 132)
            for b in sorted({0, 1, plan.blocks // 2, plan.blocks - 1}):
                lo, hi = plan.stripe(b)
                out.append((f"{label}-b{b}", lo, hi - lo, plan.pairs))
    # short pairs (one or two per tile: every step a segment end), and stripes shorter than the ring
    out += [("pairs1", 5, 7, 1), ("pairs2", 3, 6, 2), ("one-step", 13, 1, 14), ("two-steps", 13, 2, 14)]
    return out


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("name,lo,n,pairs", stripes())
def test_continuous_ring_orders_every_copy(name, lo, n, pairs, stages):
    for early_w in (True, False):
        check(continuous(lo, n, pairs, stages, early_w), lo, n, pairs, stages)


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("name,lo,n,pairs", stripes())
def test_drained_ring_orders_every_copy(name, lo, n, pairs, stages):
    check(drained(lo, n, pairs, stages), lo, n, pairs, stages)


def test_the_checker_catches_a_refill_without_a_barrier():
    """The checker is not vacuous: the continuous loop with its issue moved before the barrier refills the
    slot that other warps may still be reading."""
    ops = continuous(0, 6, 14, 3, True)
    k = next(i for i, op in enumerate(ops) if op[:2] == ("issue_w", 3))
    # move the wait/sync of that iteration after the issues
    j = max(i for i in range(k) if ops[i][0] == "sync")
    bad = ops[: j - 1] + [op for op in ops[k : k + 2]] + ops[j - 1 : k] + ops[k + 2 :]
    with pytest.raises(AssertionError, match="refilled"):
        check(bad, 0, 6, 14, 3)


def test_the_checker_catches_early_activations():
    ops = continuous(0, 4, 14, 3, True)
    bad = [("issue_x", 0)] + [op for op in ops if op != ("issue_x", 0)]
    with pytest.raises(AssertionError, match="before pdl_wait"):
        check(bad, 0, 4, 14, 3)


def test_the_checker_catches_stale_copy_rows():
    """A tile boundary inside the prologue (one pair per tile) without the rows recomputed."""
    ops = [op[:2] + (0,) if op[0] == "issue_w" else op for op in continuous(0, 3, 1, 3, True)]
    with pytest.raises(AssertionError, match="rows"):
        check(ops, 0, 3, 1, 3)


def test_the_checker_catches_a_missing_wait():
    """Two stages in flight and wait<1> dropped to a wait on nothing: step 0 would read copies that have
    not landed."""
    ops = [op if op != ("wait", 1) else ("wait", 5) for op in continuous(0, 4, 14, 3, True)]
    with pytest.raises(AssertionError, match="before its copies landed"):
        check(ops, 0, 4, 14, 3)
