"""The step timeline: when each launch of a decode step runs, read from the kernels themselves.

A diagnostic, not a benchmark. Kernels built with the define NQ_STAMPS=1 (common.cuh: every entry's first
statement is NQ_STAMP()) write, from thread 0 of every block, into a buffer whose address the host puts in
each loaded module's `nq_stamp_buf`: a start record per block (the global nanosecond timer at its start and
exit, the grid's block count, the SM) and a wait record each time it passes pdl_wait (the time, the grid's
block count). Slots are taken by atomics, so start-record order is start order across every module; and a
launch's blocks all start before the next launch's (with programmatic dependent launch the next grid
launches only once every block of this one has triggered or exited), so consecutive start records cut into
launches by grid size (`launches`). Wait records cut the same way: a launch's blocks pass pdl_wait only
once the launch before has completed. A launch whose blocks did not each wait once leaves the wait stream
uncuttable; `launches` then reports no waits at all rather than guess.

What it shows that decode_breakdown.py's per-family graphs cannot: inside the real step, how long each
launch holds the GPU (first block start -> last block exit), how early its blocks are placed before the
previous launch ends, how long they wait in pdl_wait and what follows. Stamping adds two atomics and a few
stores per block, so absolute times are slightly longer than the unstamped step's.

    buf = arm(capacity); ... replay the step ...; runs.append(launches(*read(buf))); disarm()
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import KernelError

SYMBOL = "nq_stamp_buf"
HEADER_WORDS = 4  # [0] start slots taken, [1] capacity, [2] wait slots taken (counts: low 32 bits)
RECORD_WORDS = 4  # a start record: start, exit, grid blocks | smid << 32, 0
WAIT_WORDS = 2  # a wait record: time, grid blocks


@dataclass(frozen=True)
class Launch:
    """One launch of the step, from its blocks' records (times in ns of the global timer)."""

    index: int  # position in the step (0 = the first launch recorded)
    blocks: int
    first_start: int  # the earliest block start
    last_start: int
    first_wait: int  # the earliest return from pdl_wait (0: no block waited)
    last_wait: int
    last_exit: int  # the latest block exit

    @property
    def span_us(self) -> float:
        """First block placed -> last block gone."""
        return (self.last_exit - self.first_start) / 1e3


def _point_modules(address: int) -> int:
    """Write `address` into every loaded module's stamp-buffer pointer; how many modules have one."""
    import cupy as cp

    from .loader import loaded_modules

    value = np.array([address], dtype=np.uint64)
    n = 0
    for m in loaded_modules():
        addr = m.global_address(SYMBOL)
        if addr is not None:
            cp.cuda.runtime.memcpy(addr, value.ctypes.data, 8, cp.cuda.runtime.memcpyHostToDevice)
            n += 1
    return n


def arm(capacity: int):
    """A zeroed stamp buffer for `capacity` block records, pointed at by every loaded module that has the
    symbol (those built with NQ_STAMPS=1). KernelError when none has it."""
    import cupy as cp

    buf = cp.zeros(HEADER_WORDS + (RECORD_WORDS + WAIT_WORDS) * capacity, dtype=cp.uint64)
    buf[1] = capacity
    if not _point_modules(buf.data.ptr):
        raise KernelError(
            f"no loaded module has {SYMBOL}: build the kernels with NANOQWEN_KERNEL_DEFINES=NQ_STAMPS=1"
        )
    return buf


def disarm() -> None:
    """Point every module's stamp buffer back at nothing (the kernels then record nothing)."""
    _point_modules(0)


def reset(buf) -> None:
    """Empty an armed buffer (slots count from 0 again)."""
    buf[0] = 0
    buf[2] = 0


def read(buf) -> tuple[np.ndarray, np.ndarray]:
    """The start records, uint64 [n, 4] in slot (start) order, and the wait records, [m, 2] in slot order.
    KernelError if the buffer overflowed."""
    host = buf.get() if hasattr(buf, "get") else np.asarray(buf)
    n, cap, m = int(host[0] & 0xFFFFFFFF), int(host[1]), int(host[2] & 0xFFFFFFFF)
    if n > cap or m > cap:
        raise KernelError(
            f"the stamp buffer overflowed: {n} blocks, {m} waits for {cap} records (arm a larger one)"
        )
    starts = host[HEADER_WORDS : HEADER_WORDS + RECORD_WORDS * n].reshape(n, RECORD_WORDS)
    w0 = HEADER_WORDS + RECORD_WORDS * cap
    return starts, host[w0 : w0 + WAIT_WORDS * m].reshape(m, WAIT_WORDS)


def _cut(grid: np.ndarray, what: str) -> list[slice]:
    """Consecutive runs of `g` entries that all say g: one per launch."""
    out, i = [], 0
    while i < len(grid):
        g = int(grid[i])
        if g <= 0 or i + g > len(grid) or np.any(grid[i : i + g] != g):
            raise KernelError(f"{what} {i}..{i + g - 1} are not one launch of {g} blocks (launch {len(out)})")
        out.append(slice(i, i + g))
        i += g
    return out


def launches(starts: np.ndarray, waits: np.ndarray | None = None) -> list[Launch]:
    """Cut start records (slot order) into launches: a launch is the next `grid` records, `grid` read from
    the first of them, and every one of them must name the same grid size (KernelError otherwise: a launch
    whose blocks did not all record, or two launches interleaved). Wait records the same way, matched to
    the launches in order; where they do not cut into exactly one run per launch with the same grids, the
    launches carry no waits (first_wait = last_wait = 0)."""
    starts = np.asarray(starts, dtype=np.uint64).reshape(-1, RECORD_WORDS)
    runs = _cut((starts[:, 2] & 0xFFFFFFFF).astype(np.int64), "start records")
    wait_t: list[np.ndarray | None] = [None] * len(runs)
    if waits is not None and len(waits):
        waits = np.asarray(waits, dtype=np.uint64).reshape(-1, WAIT_WORDS)
        wgrid = waits[:, 1].astype(np.int64)
        try:
            wruns = _cut(wgrid, "wait records")
        except KernelError:
            wruns = []
        if len(wruns) == len(runs) and all(
            int(wgrid[w.start]) == int(starts[r.start, 2] & 0xFFFFFFFF)
            for w, r in zip(wruns, runs, strict=True)
        ):
            wait_t = [waits[w, 0].astype(np.int64) for w in wruns]
    out: list[Launch] = []
    for k, r in enumerate(runs):
        rec = starts[r].astype(np.int64)
        wt = wait_t[k]
        out.append(
            Launch(
                index=k,
                blocks=r.stop - r.start,
                first_start=int(rec[:, 0].min()),
                last_start=int(rec[:, 0].max()),
                first_wait=int(wt.min()) if wt is not None else 0,
                last_wait=int(wt.max()) if wt is not None else 0,
                last_exit=int(rec[:, 1].max()),
            )
        )
    return out


def step_table(runs: list[list[Launch]], names: list[str]) -> list[dict]:
    """Per position of the step (names[k] for the k-th launch of every run; runs are replays of the same
    step, so they must have len(names) launches each), the median over runs of:
      span_us    first block start -> last block exit;
      placed_us  how long before the previous launch's last exit its first block started (> 0: overlap);
      waited_us  first block start -> first return from pdl_wait (how long blocks sat placed but waiting);
      after_us   the previous launch's last exit -> this one's first return from pdl_wait (the hand-off);
      tail_us    the last return from pdl_wait -> the last exit (this launch's work after its inputs);
    and the step: first start of launch 0 -> last exit of the last launch."""
    if not runs:
        raise KernelError("no runs to tabulate")
    for r in runs:
        if len(r) != len(names):
            raise KernelError(f"a run has {len(r)} launches, the step names {len(names)}")
    rows = []
    for k, name in enumerate(names):
        span, placed, waited, after, tail = [], [], [], [], []
        for r in runs:
            cur = r[k]
            span.append(cur.span_us)
            if cur.first_wait:
                waited.append((cur.first_wait - cur.first_start) / 1e3)
                tail.append((cur.last_exit - cur.last_wait) / 1e3)
            if k:
                prev = r[k - 1]
                placed.append((prev.last_exit - cur.first_start) / 1e3)
                if cur.first_wait:
                    after.append((cur.first_wait - prev.last_exit) / 1e3)
        med = lambda v: float(np.median(v)) if v else float("nan")  # noqa: E731
        rows.append(
            {
                "position": k,
                "name": name,
                "blocks": runs[0][k].blocks,
                "span_us": med(span),
                "placed_us": med(placed),
                "waited_us": med(waited),
                "after_us": med(after),
                "tail_us": med(tail),
            }
        )
    step = [(r[-1].last_exit - r[0].first_start) / 1e3 for r in runs]
    rows.append(
        {
            "position": len(names),
            "name": "step",
            "blocks": sum(x.blocks for x in runs[0]),
            "span_us": float(np.median(step)),
            "placed_us": float("nan"),
            "waited_us": float("nan"),
            "after_us": float("nan"),
            "tail_us": float("nan"),
        }
    )
    return rows
