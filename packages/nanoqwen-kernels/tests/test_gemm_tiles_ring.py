"""CPU: the tile GEMM's warp-specialized ring (gemm_tiles.cuh), its mbarrier hand-over under every order of
events the hardware allows.

The GPU tests check the results; this checks the protocol the results rest on, for every stage count and
stripe length, in CI. The producer and the 16 consumer warps are written out as gemm_tiles runs them: the
producer, per step i of its stripe, waits on empty[i % S] with parity (i / S + 1) & 1 once i >= S, issues the
stage's weights and x (the order against pdl_wait is the SASS test's: test_compile.py), then its cp.async arrival on full[i % S], which fires
only once all of its earlier copies have landed; a consumer waits on full[i % S] with parity (i / S) & 1,
reads the stage (for as long as it likes: its wgmmas), then arrives on empty[i % S]. The mbarriers follow
PTX's rules: a phase completes when its pending count reaches zero (then the count is re-armed), and a
parity wait passes while the barrier's current phase parity differs from the one waited for. A random
scheduler interleaves every enabled event, many times per case, and asserts:
- a consumer reads only a stage that holds the copies of its own step, landed;
- the producer writes a stage only after every consumer has finished with the step it held;
- every step is produced once and read once by every consumer, and the run ends (no deadlock).
Negative runs show the checker catches a wrong parity on either side and a consumer that releases a
stage before it has read it.
"""

import random

import pytest

CONSUMERS = 16


class Barrier:
    def __init__(self, count: int):
        self.count, self.pending, self.phase = count, count, 0

    def arrive(self) -> None:
        self.pending -= 1
        assert self.pending >= 0
        if self.pending == 0:
            self.phase += 1
            self.pending = self.count

    def passes(self, parity: int) -> bool:
        """try_wait.parity: the phase of that parity has completed (the current one has the other)."""
        return (self.phase & 1) != parity


class Violation(AssertionError):
    pass


def run(n: int, stages: int, seed: int, producer_parity=None, consumer_parity=None, early_release=False) -> None:
    """One interleaving of a block's stripe of n steps over `stages` stages."""
    rng = random.Random(seed)
    producer_parity = producer_parity or (lambda i, s: (i // s + 1) & 1)
    consumer_parity = consumer_parity or (lambda i, s: (i // s) & 1)
    full = [Barrier(1) for _ in range(stages)]  # one producer arrival per phase (the kernel: 32 x producers)
    empty = [Barrier(CONSUMERS) for _ in range(stages)]
    slot: list[tuple[str, int] | None] = [None] * stages  # ("flight" | "landed", step)
    in_flight: list[int] = []  # steps issued, not yet landed, oldest first
    produced = 0
    reading: dict[int, int] = {}  # consumer -> step it is reading
    done = [0] * CONSUMERS  # steps finished by each consumer
    reads = [[] for _ in range(CONSUMERS)]

    def producer_ready() -> bool:
        i = produced
        return i < n and (i < stages or empty[i % stages].passes(producer_parity(i, stages)))

    for _ in range(100 * n * (CONSUMERS + 2) + 100):
        actions = []
        if producer_ready():
            actions.append(("produce",))
        if in_flight:
            actions.append(("land",))
        for c in range(CONSUMERS):
            j = done[c]
            if c in reading:
                actions.append(("release", c))
            elif j < n and full[j % stages].passes(consumer_parity(j, stages)):
                actions.append(("read", c))
        if not actions:
            break
        act = rng.choice(actions)
        if act[0] == "produce":
            i, st = produced, produced % stages
            if i >= stages and any(done[c] < i - stages + 1 for c in range(CONSUMERS)):
                raise Violation(f"step {i} overwrites stage {st} while step {i - stages} is still being read")
            slot[st] = ("flight", i)
            in_flight.append(i)
            produced += 1
        elif act[0] == "land":  # copies land in order; the arrival of step i fires after all earlier ones
            i = in_flight.pop(0)
            slot[i % stages] = ("landed", i)
            full[i % stages].arrive()
        elif act[0] == "read":
            c = act[1]
            j = done[c]
            if slot[j % stages] != ("landed", j):
                raise Violation(f"consumer {c} reads step {j} from stage {j % stages} holding {slot[j % stages]}")
            reading[c] = j
            reads[c].append(j)
            if early_release:  # the stage released at once, then read
                empty[j % stages].arrive()
        else:
            c = act[1]
            j = reading.pop(c)
            if slot[j % stages] != ("landed", j):
                raise Violation(f"stage {j % stages} changed under consumer {c} reading step {j}")
            if not early_release:
                empty[j % stages].arrive()
            done[c] += 1
    if produced != n or any(d != n for d in done):
        raise Violation(f"deadlock: produced {produced}, consumers done {sorted(set(done))} of {n}")
    assert all(r == list(range(n)) for r in reads)


CASES = [(s, n) for s in (2, 3, 4, 5, 8) for n in sorted({1, s - 1, s, s + 1, 3 * s + 2, 29})]


@pytest.mark.parametrize("stages,n", CASES)
def test_ring_hands_every_stage_over_in_order(stages, n):
    for seed in range(20):
        run(n, stages, seed)


def _fails(**kw) -> bool:
    for seed in range(200):
        try:
            run(17, 3, seed, **kw)
        except Violation:
            return True
    return False


def test_the_checker_catches_a_wrong_producer_parity():
    assert _fails(producer_parity=lambda i, s: (i // s) & 1)


def test_the_checker_catches_a_wrong_consumer_parity():
    assert _fails(consumer_parity=lambda i, s: (i // s + 1) & 1)


def test_the_checker_catches_an_early_release():
    assert _fails(early_release=True)
