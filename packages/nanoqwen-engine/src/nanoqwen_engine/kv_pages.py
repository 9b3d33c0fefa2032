"""Paged KV cache bookkeeping: the page pool, its free list, and one page table per sequence.

Pure Python/numpy and shared by both backends: this file decides WHICH page holds a token; the backend
owns the cache arrays themselves (numpy on the CPU, CuPy on the GPU) in the layout below, which the GPU
attention kernels read byte for byte (docs/INTERFACES.md section 3).

    k_cache, v_cache: [n_layers, n_pages, n_kv_heads, PAGE_TOKENS, head_dim]   (fp16 on the GPU)

    one page of one KV head (head_dim 128, fp16) = 16 tokens x 128 x 2 B = 4 KiB, contiguous:

      page p, head h:  +-------- 256 B --------+
                       | token slot 0  (128 x fp16) |   offset 0
                       | token slot 1               |   offset 256
                       | ...                        |
                       | token slot 15              |   offset 3840
                       +----------------------------+   4096 B

    a page id means the same page in every layer (layer l's copy is k_cache[l, p]):

      k_cache[l] = | page 0: head 0 | head 1 | .. | head n_kv-1 | page 1: head 0 | ... |
                     <- 4 KiB ->

    sequence s, page_table[s] = int32 [max_pages_per_seq], logical block b -> page id (-1 = none):

      tokens  0..15   16..31   32..47   48..
      block     0        1        2      3 ...
      page     [7]      [2]      [12]    -1 ...

      token t lives at page_table[t // 16], slot t % 16.

Allocation is all-or-nothing: `grow` either gives a sequence every page it asks for or raises
KVPagesExhaustedError with the pool and every sequence exactly as they were.
"""

from __future__ import annotations

import numpy as np

from .errors import KVPagesExhaustedError, PromptTooLongError

PAGE_TOKENS = 16  # tokens per page; fixed by the kernels (docs/INTERFACES.md section 3)


def pages_for(n_tokens: int) -> int:
    """Pages needed to hold n_tokens tokens."""
    return -(-n_tokens // PAGE_TOKENS)


def kv_cache_shape(n_layers: int, n_pages: int, n_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Shape of k_cache (and v_cache): [n_layers, n_pages, n_kv_heads, 16, head_dim]."""
    return (n_layers, n_pages, n_kv_heads, PAGE_TOKENS, head_dim)


def kv_cache_bytes(n_layers: int, n_pages: int, n_kv_heads: int, head_dim: int, itemsize: int = 2) -> int:
    """Bytes of K plus V for a pool of n_pages pages."""
    return 2 * n_layers * n_pages * n_kv_heads * PAGE_TOKENS * head_dim * itemsize


class SequenceState:
    """One sequence's view of the cache: its page table and how many tokens are cached.

    `length` counts tokens whose K/V are written; the backend raises it after a successful write.
    """

    __slots__ = ("seq_id", "page_table", "n_pages", "length")

    def __init__(self, seq_id: int, max_pages: int):
        self.seq_id = seq_id
        self.page_table = np.full(max_pages, -1, dtype=np.int32)  # int32 [max_pages_per_seq]
        self.n_pages = 0  # entries [0, n_pages) of page_table are valid
        self.length = 0  # tokens cached

    @property
    def capacity(self) -> int:
        """Tokens the allocated pages can hold."""
        return self.n_pages * PAGE_TOKENS

    def pages(self) -> np.ndarray:
        return self.page_table[: self.n_pages]

    def slot_of(self, t: int) -> tuple[int, int]:
        """(page id, slot) of token position t."""
        return int(self.page_table[t // PAGE_TOKENS]), t % PAGE_TOKENS

    def __repr__(self) -> str:
        return f"SequenceState(id={self.seq_id}, length={self.length}, pages={self.pages().tolist()})"


class PagePool:
    """Hands out page ids from a free list to sequences; every page belongs to at most one sequence."""

    def __init__(self, n_pages: int, max_pages_per_seq: int):
        if n_pages < 1 or max_pages_per_seq < 1:
            raise ValueError(f"PagePool needs n_pages >= 1 and max_pages_per_seq >= 1, got {n_pages}, {max_pages_per_seq}")
        self.n_pages = n_pages
        self.max_pages_per_seq = max_pages_per_seq
        # Lowest ids popped first: a fresh pool hands out 0, 1, 2, ... which keeps layouts easy to read
        # in a debugger; reuse order is LIFO (a freed page is still warm in cache).
        self._free: list[int] = list(range(n_pages - 1, -1, -1))
        self._seqs: dict[int, SequenceState] = {}
        self._next_id = 0

    @property
    def max_tokens_per_seq(self) -> int:
        return self.max_pages_per_seq * PAGE_TOKENS

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_used(self) -> int:
        return self.n_pages - len(self._free)

    @property
    def sequences(self) -> list[SequenceState]:
        return list(self._seqs.values())

    def new_sequence(self) -> SequenceState:
        """A sequence with no pages yet (allocation happens in `grow`)."""
        seq = SequenceState(self._next_id, self.max_pages_per_seq)
        self._next_id += 1
        self._seqs[seq.seq_id] = seq
        return seq

    def grow(self, seq: SequenceState, n_tokens: int) -> None:
        """Make seq's pages hold at least n_tokens tokens (all-or-nothing).

        Raises PromptTooLongError when n_tokens exceeds a sequence's page table, KVPagesExhaustedError
        when the free list is too short; in both cases nothing changes.
        """
        self._check_live(seq)
        need = pages_for(n_tokens) - seq.n_pages
        if need <= 0:
            return
        if pages_for(n_tokens) > self.max_pages_per_seq:
            raise PromptTooLongError(
                f"{n_tokens} tokens exceed the per-sequence limit of {self.max_tokens_per_seq} tokens"
            )
        if need > len(self._free):
            raise KVPagesExhaustedError(
                f"KV cache full: need {need} more pages of {PAGE_TOKENS} tokens, {len(self._free)} of "
                f"{self.n_pages} free ({len(self._seqs)} live sequences)"
            )
        for _ in range(need):
            seq.page_table[seq.n_pages] = self._free.pop()
            seq.n_pages += 1

    def grow_many(self, wants) -> None:
        """grow(seq, n_tokens) for each (seq, n_tokens) of `wants`, all or none: on a failure the
        sequences grown before it are shrunk back and the error raised (a batched prefill's growth)."""
        grown = []
        try:
            for seq, n_tokens in wants:
                grown.append((seq, seq.n_pages))
                self.grow(seq, n_tokens)
        except Exception:
            for seq, n_pages in grown:
                self.shrink(seq, n_pages)
            raise

    def shrink(self, seq: SequenceState, n_pages: int) -> None:
        """Give back seq's pages past its first n_pages (undoes a `grow`; the tokens they held are gone,
        so `length` is capped at what the remaining pages hold)."""
        self._check_live(seq)
        while seq.n_pages > max(n_pages, 0):
            seq.n_pages -= 1
            self._free.append(int(seq.page_table[seq.n_pages]))
            seq.page_table[seq.n_pages] = -1
        seq.length = min(seq.length, seq.capacity)

    def free(self, seq: SequenceState) -> None:
        """Return seq's pages to the pool; the sequence is dead afterwards. Freeing twice is a no-op."""
        if self._seqs.pop(seq.seq_id, None) is None:
            return
        # Reversed so the sequence's first page is the next one handed out (LIFO).
        self._free.extend(int(p) for p in reversed(seq.pages()))
        seq.page_table[:] = -1
        seq.n_pages = 0
        seq.length = 0

    def _check_live(self, seq: SequenceState) -> None:
        if self._seqs.get(seq.seq_id) is not seq:
            raise ValueError(f"sequence {seq.seq_id} is not live in this pool (already freed?)")
