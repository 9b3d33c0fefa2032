"""PagePool: allocation, exhaustion (all-or-nothing), freeing, reuse, many sequences, state machine."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from nanoqwen_engine import KVPagesExhaustedError, PromptTooLongError
from nanoqwen_engine.kv_pages import PAGE_TOKENS, PagePool, kv_cache_bytes, kv_cache_shape, pages_for


def snapshot(pool: PagePool):
    return (sorted(pool._free), pool.n_free,
            {s.seq_id: (s.page_table.copy().tolist(), s.n_pages, s.length) for s in pool.sequences})


def test_layout_numbers_match_the_interface():
    # one page of one KV head is 16 x 128 x fp16 = 4 KiB
    assert PAGE_TOKENS == 16
    assert kv_cache_shape(28, 10, 4, 128) == (28, 10, 4, 16, 128)
    assert kv_cache_bytes(1, 1, 1, 128) == 2 * 4096  # K and V
    assert [pages_for(n) for n in (0, 1, 15, 16, 17, 31, 32, 33)] == [0, 1, 1, 1, 2, 2, 2, 3]


def test_grow_maps_tokens_to_pages():
    pool = PagePool(8, 4)
    s = pool.new_sequence()
    pool.grow(s, 17)
    assert s.n_pages == 2 and s.capacity == 32
    assert s.slot_of(0) == (int(s.page_table[0]), 0)
    assert s.slot_of(16) == (int(s.page_table[1]), 0)
    assert s.slot_of(31) == (int(s.page_table[1]), 15)
    assert (s.page_table[2:] == -1).all() and s.page_table.dtype == np.int32
    pool.grow(s, 20)  # fits the pages it has: nothing new
    assert s.n_pages == 2 and pool.n_free == 6


def test_exhaustion_leaves_everything_unchanged():
    pool = PagePool(5, 8)
    a, b = pool.new_sequence(), pool.new_sequence()
    pool.grow(a, 40)  # 3 pages
    pool.grow(b, 16)  # 1 page
    before = snapshot(pool)
    with pytest.raises(KVPagesExhaustedError, match="need 2 more pages"):
        pool.grow(b, 48)  # needs 2 more, 1 free
    assert snapshot(pool) == before
    with pytest.raises(PromptTooLongError):
        pool.grow(b, 8 * 16 + 1)  # past the page table
    assert snapshot(pool) == before
    pool.grow(b, 32)  # the one free page still serves
    assert pool.n_free == 0


def test_grow_many_is_all_or_nothing():
    """grow_many: every sequence grows, or (the second cannot) none does: the first is shrunk back to
    its pages before the call and the error is the one grow raised."""
    pool = PagePool(5, 8)
    a, b, c = pool.new_sequence(), pool.new_sequence(), pool.new_sequence()
    pool.grow(a, 10)  # 1 page
    before = snapshot(pool)
    with pytest.raises(KVPagesExhaustedError):
        pool.grow_many([(a, 40), (b, 40)])  # a takes 2 more, b would need 3 of the 2 left
    assert snapshot(pool) == before
    with pytest.raises(PromptTooLongError):
        pool.grow_many([(b, 16), (c, 8 * 16 + 1)])
    assert snapshot(pool) == before
    pool.grow_many([(a, 32), (b, 16), (c, 17)])
    assert (a.n_pages, b.n_pages, c.n_pages, pool.n_free) == (2, 1, 2, 0)


def test_free_returns_pages_for_reuse():
    pool = PagePool(4, 4)
    a = pool.new_sequence()
    pool.grow(a, 64)
    pages = set(a.pages().tolist())
    assert pool.n_free == 0
    pool.free(a)
    assert pool.n_free == 4 and a.n_pages == 0 and (a.page_table == -1).all()
    pool.free(a)  # twice: no-op
    assert pool.n_free == 4
    b = pool.new_sequence()
    pool.grow(b, 64)
    assert set(b.pages().tolist()) == pages
    with pytest.raises(ValueError, match="not live"):
        pool.grow(a, 1)


def test_many_sequences_get_disjoint_pages(rng):
    pool = PagePool(200, 16)
    seqs = [pool.new_sequence() for _ in range(30)]
    for s in seqs:
        pool.grow(s, int(rng.integers(1, 100)))
    used = np.concatenate([s.pages() for s in seqs])
    assert len(set(used.tolist())) == len(used) == pool.n_used
    for s in seqs[::2]:
        pool.free(s)
    for s in seqs[1::2]:
        pool.grow(s, 16 * 12)  # 15 x 12 = 180 of 200 pages
    used = np.concatenate([s.pages() for s in pool.sequences])
    assert len(set(used.tolist())) == len(used) == pool.n_used


class PoolMachine(RuleBasedStateMachine):
    """Random grow/free sequences against a simple model: a page belongs to at most one sequence,
    free + used == total, and a failed grow changes nothing."""

    def __init__(self):
        super().__init__()
        self.pool = PagePool(12, 5)
        self.want: dict[int, int] = {}  # seq_id -> tokens it asked for (model)

    @rule()
    def new(self):
        s = self.pool.new_sequence()
        self.want[s.seq_id] = 0

    @precondition(lambda self: self.want)
    @rule(data=st.data(), n=st.integers(0, 5 * 16 + 20))
    def grow(self, data, n):
        sid = data.draw(st.sampled_from(sorted(self.want)))
        s = self.pool._seqs[sid]
        before = snapshot(self.pool)
        need = pages_for(n) - s.n_pages
        try:
            self.pool.grow(s, n)
        except PromptTooLongError:
            assert pages_for(n) > 5
            assert snapshot(self.pool) == before
        except KVPagesExhaustedError:
            assert need > before[1]
            assert snapshot(self.pool) == before
        else:
            self.want[sid] = max(self.want[sid], n)
            assert s.capacity >= n

    @precondition(lambda self: self.want)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.want)))
        n = self.pool._seqs[sid].n_pages
        free_before = self.pool.n_free
        self.pool.free(self.pool._seqs[sid])
        del self.want[sid]
        assert self.pool.n_free == free_before + n

    @invariant()
    def consistent(self):
        owned = [p for s in self.pool.sequences for p in s.pages().tolist()]
        assert len(owned) == len(set(owned))
        assert not set(owned) & set(self.pool._free)
        assert len(owned) + self.pool.n_free == self.pool.n_pages
        for s in self.pool.sequences:
            assert s.n_pages == pages_for(self.want[s.seq_id])
            assert (s.page_table[s.n_pages:] == -1).all()


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
