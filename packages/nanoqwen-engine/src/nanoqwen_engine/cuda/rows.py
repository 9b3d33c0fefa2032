"""Which sequence sits in which row of the batched decode step, and which captured graph (bucket) runs.

The decode step is captured once per batch bucket (BUCKETS: 1, 2, 4, ..., max_batch) and runs rows
[0, bucket) of every device buffer. A sequence keeps its row from step to step while it stays in the
batch, so its device state (token, position, page table, sampler parameters and history) is uploaded
once, when it takes the row, and not again: a steady batch costs one small H2D copy per step (the new
page ids), whatever the order the caller lists the sequences in.

    step k:   rows  0    1    2    3        bucket 4 (3 sequences + 1 idle row)
                   [s7] [s2] [  ] [s9]
    s2 ends, s4 and s5 arrive:
    step k+1: rows  0    1    2    3        s4 takes the lowest free row, s5 the next
                   [s7] [s4] [s5] [s9]

Rows inside the bucket that no sequence holds are idle: they run with length 0 on a scratch page and
their results are dropped (decode.py). When the batch shrinks below its bucket's half, sequences in rows
past the smaller bucket move down into free rows (and are uploaded again), so the step runs the
smallest graph that holds the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def buckets_for(max_batch: int) -> tuple[int, ...]:
    """The graph sizes a backend of max_batch rows captures: the powers of two below it, then max_batch."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    return tuple(b for b in BUCKETS if b < max_batch) + (max_batch,)


class RowAssignment:
    """seq_id -> row, stable across steps (see the module doc)."""

    def __init__(self, max_batch: int):
        self.buckets = buckets_for(max_batch)
        self.owner: list[int | None] = [None] * max_batch  # row -> seq_id

    def bucket(self, n: int) -> int:
        """The smallest bucket holding n rows."""
        for b in self.buckets:
            if n <= b:
                return b
        raise ValueError(f"{n} rows exceed the largest bucket {self.buckets[-1]}")

    def assign(self, seq_ids: Sequence[int]) -> tuple[list[int], int, list[int]]:
        """Rows for this step's sequences (distinct ids, at most max_batch of them).

        Returns (rows, bucket, moved): rows[i] is seq_ids[i]'s row, every row < bucket; `moved` lists
        the rows whose sequence is new there (their device state must be uploaded). Sequences absent from
        this step lose their rows."""
        bucket = self.bucket(len(seq_ids))
        live = set(seq_ids)
        where = {}
        for r, sid in enumerate(self.owner):
            if sid is None:
                continue
            if sid in live and r < bucket:
                where[sid] = r
            else:  # left the batch, or sits past the bucket: it will take a lower row
                self.owner[r] = None
        free = (r for r in range(bucket) if self.owner[r] is None)
        moved = []
        for sid in seq_ids:
            if sid not in where:
                r = next(free)  # exists: fewer than `bucket` rows below it are held by others
                self.owner[r] = sid
                where[sid] = r
                moved.append(r)
        return [where[sid] for sid in seq_ids], bucket, moved

    def release(self, seq_id: int) -> None:
        """Forget seq_id's row (its device state no longer describes it, e.g. after a prefill)."""
        self.owner = [None if sid == seq_id else sid for sid in self.owner]

    def clear(self) -> None:
        """Forget every row (after an error: nothing on the device is trusted)."""
        self.owner = [None] * len(self.owner)
