"""The scheduler on a stand-in backend whose "model" reads every token back from the KV pages.

`PagedEcho` stores token ids in a page-indexed array laid out like the real cache and computes each
next id from the sequence's tokens read back through its page table (plus one draw from the request's
own RNG when it samples). A page handed to two sequences, freed too early, or written at the wrong slot
changes a later id, so "every request ends with exactly the tokens it produces alone" checks the
bookkeeping of the pool, the page tables, chunked prefill, batching and preemption, thousands of steps
a second. The real model's numbers under batching are test_batching.py's.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_testutil import pool_idle
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from nanoqwen_engine.kv_pages import PAGE_TOKENS, PagePool, pages_for
from nanoqwen_engine.params import SamplingParams
from nanoqwen_engine.request import Request, RequestHandle
from nanoqwen_engine.sampler import SamplerState
from nanoqwen_engine.scheduler import Scheduler

V = 1000
EOS = 7


def next_id(tokens: list[int], sampler: SamplerState) -> int:
    """The stand-in model: a hash of every token, plus an RNG draw when the request samples."""
    h = 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    if sampler.params.temperature > 0:
        h += int(sampler.rng.integers(0, V))
    return h % V


class PagedEcho:
    """The Backend protocol over a token-id "cache" in the real page layout."""

    def __init__(self, n_pages: int, max_context: int, open_ahead: bool = False):
        self.pool = PagePool(n_pages, pages_for(max_context))
        # open_ahead: on a run_ahead hint, give every sequence whose next position opens a page that page
        # now, all or none, as the CUDA backend does before launching a step ahead (_open_next_pages)
        self.open_ahead = open_ahead
        self.max_context = max_context
        self.cache = np.full((n_pages, PAGE_TOKENS), -1, dtype=np.int64)
        self.calls: list[tuple[str, int]] = []  # ("decode", B) / ("prefill", T)
        self.ahead: list[tuple[tuple[int, ...], bool]] = []  # per decode: (seq ids, the run_ahead hint)

    def _write(self, seq, ids) -> None:
        for t in ids:
            page, slot = seq.slot_of(seq.length)
            self.cache[page, slot] = t
            seq.length += 1

    def _read(self, seq) -> list[int]:
        pos = np.arange(seq.length)
        return self.cache[seq.page_table[pos // PAGE_TOKENS], pos % PAGE_TOKENS].tolist()

    def prefill(self, seq, token_ids, sampler):
        self.pool.grow(seq, seq.length + len(token_ids))
        self._write(seq, [int(t) for t in token_ids])
        self.calls.append(("prefill", len(token_ids)))
        return None if sampler is None else next_id(self._read(seq), sampler)

    def prefill_many(self, items):
        self.calls.append(("prefill_many", len(items)))
        return [self.prefill(*it) for it in items]

    def decode(self, seqs, token_ids, samplers, run_ahead=False):
        self.ahead.append((tuple(s.seq_id for s in seqs), run_ahead))
        need = sum(pages_for(s.length + 1) - s.n_pages for s in seqs)
        assert need <= self.pool.n_free, "the scheduler must reserve decode pages"
        for s in seqs:
            self.pool.grow(s, s.length + 1)
        for s, t in zip(seqs, token_ids, strict=True):
            self._write(s, [int(t)])
        self.calls.append(("decode", len(seqs)))
        out = [next_id(self._read(s), sp) for s, sp in zip(seqs, samplers, strict=True)]
        if run_ahead and self.open_ahead:
            opening = [s for s in seqs if s.length >= s.capacity]
            if len(opening) <= self.pool.n_free and all(s.n_pages < self.pool.max_pages_per_seq for s in opening):
                for s in opening:
                    self.pool.grow(s, s.length + 1)
        return out


def solo(prompt: list[int], params: SamplingParams, max_context: int) -> list[int]:
    """The tokens one request produces alone (no pool limits): the reference for every test here."""
    sampler = SamplerState(params, V)
    toks, out = list(prompt), []
    while True:
        t = next_id(toks, sampler)
        out.append(t)
        if t == EOS or len(out) >= params.max_tokens or len(toks) >= max_context:
            return out
        toks.append(t)


def make_request(rid: int, prompt: list[int], params: SamplingParams, tokenizer, max_context: int) -> Request:
    req: Request

    def cancel():
        req.cancel_requested = True

    handle = RequestHandle(rid, len(prompt), cancel)
    req = Request(rid, prompt, params, SamplerState(params, V), tokenizer.stream(), (EOS,), max_context, handle)
    return req


def params_for(max_tokens: int, seed: int | None) -> SamplingParams:
    t = 0.0 if seed is None else 0.8
    return SamplingParams(temperature=t, max_tokens=max_tokens, seed=seed).resolve({})


def drain(sched: Scheduler, limit: int = 100_000) -> int:
    steps = 0
    while sched.has_work():
        sched.step()
        steps += 1
        assert steps < limit, "the scheduler stopped making progress"
    return steps


def check_pool(sched: Scheduler) -> None:
    pool = sched.pool
    live = [r for r in sched.running]
    assert pool.n_used == sum(r.seq.n_pages for r in live)
    assert sorted(s.seq_id for s in pool.sequences) == sorted(r.seq.seq_id for r in live)
    pages = np.concatenate([r.seq.pages() for r in live]) if live else np.array([], dtype=np.int32)
    assert len(set(pages.tolist())) == len(pages), "a page belongs to two sequences"
    assert all(r.seq is None for r in sched.waiting)
    assert len(sched.running) <= sched.max_batch
    for r in live:  # a running request holds its whole prompt's pages from admission
        assert r.seq.n_pages >= pages_for(r.prefill_target)
        assert r.seq.length <= r.prefill_target
        # ... and at most one page past what its next token needs (one opened ahead of a step run ahead)
        assert r.seq.n_pages <= max(pages_for(r.prefill_target), pages_for(r.seq.length + 1)) + 1


# -- policy, step by step --------------------------------------------------------------------------------

def test_long_prompt_is_chunked_while_others_decode(tokenizer, rng):
    be = PagedEcho(n_pages=40, max_context=512)
    sched = Scheduler(be, max_batch=4, prefill_chunk=32)
    short = make_request(0, rng.integers(0, V, 5).tolist(), params_for(50, None), tokenizer, 512)
    long = make_request(1, rng.integers(0, V, 200).tolist(), params_for(5, None), tokenizer, 512)
    sched.waiting.append(short)
    sched.step()  # short prefilled whole, first token out
    assert short.output and short.decoding
    sched.waiting.append(long)
    for _ in range(7):  # 200 prompt tokens in chunks of 32: 7 steps, short decoding in every one
        before = len(short.output)
        plan = sched.step()
        assert plan.decode == [short] and len(short.output) == before + 1
        assert [n for _, n in plan.prefill] == [min(32, 200 - 32 * _)]
    assert long.output and be.calls.count(("decode", 1)) == 7
    drain(sched)
    assert short.handle.result().token_ids == solo(short.prompt, short.params, 512)
    assert long.handle.result().token_ids == solo(long.prompt, long.params, 512)


def test_a_prompt_alone_takes_the_idle_budget_and_shrinks_to_the_chunk_beside_decoding(tokenizer, rng):
    """prefill_chunk_idle: with no row decoding, a step prefills up to the idle budget (a lone long prompt
    in few large passes); once a request decodes, the next prompt's chunks shrink to prefill_chunk. Tokens
    as solo either way."""
    be = PagedEcho(n_pages=60, max_context=512)
    sched = Scheduler(be, max_batch=4, prefill_chunk=32, prefill_chunk_idle=128)
    a = make_request(0, rng.integers(0, V, 300).tolist(), params_for(40, None), tokenizer, 512)
    sched.waiting.append(a)
    sizes = [n for _, n in sched.step().prefill]
    assert sizes == [128] and not a.decoding
    assert [n for _, n in sched.step().prefill] == [128]
    plan = sched.step()  # the last 44 tokens, and a's first token comes out of them
    assert [n for _, n in plan.prefill] == [44] and a.decoding
    b = make_request(1, rng.integers(0, V, 100).tolist(), params_for(5, None), tokenizer, 512)
    sched.waiting.append(b)
    plan = sched.step()
    assert plan.decode == [a] and [n for _, n in plan.prefill] == [32]
    drain(sched)
    for r in (a, b):
        assert r.handle.result().token_ids == solo(r.prompt, r.params, 512)
    assert Scheduler(be, max_batch=4, prefill_chunk=64, prefill_chunk_idle=16).prefill_chunk_idle == 64
    assert Scheduler(be, max_batch=4, prefill_chunk=64).prefill_chunk_idle == 64


def test_run_ahead_hint_only_when_the_next_step_is_foreseeably_the_same(tokenizer, rng):
    """Backend.decode's run_ahead: given while the same rows will decode next, withheld at a step that
    prefills (a completing prompt joins), while a waiting request could be admitted, and at a row's
    last token by max_tokens. Whenever it was given, the next decode call had the same sequences unless
    one stopped on an end token (unforeseeable: that backend step is discarded)."""
    be = PagedEcho(n_pages=40, max_context=512)
    sched = Scheduler(be, max_batch=4, prefill_chunk=32)
    a = make_request(0, rng.integers(0, V, 5).tolist(), params_for(12, None), tokenizer, 512)
    sched.waiting.append(a)
    sched.step()  # a's prompt, first token
    owner = {a.seq.seq_id: a}
    for _ in range(3):
        sched.step()
    assert be.ahead[-1][1] is True  # a alone, decoding, more to come
    b = make_request(1, rng.integers(0, V, 40).tolist(), params_for(12, None), tokenizer, 512)
    sched.waiting.append(b)
    plan = sched.step()  # b admitted and its first chunk prefilled beside a's decode
    assert plan.prefill and be.ahead[-1][1] is False
    owner[b.seq.seq_id] = b
    plan = sched.step()  # b's last chunk: still a prefill step
    assert plan.prefill and be.ahead[-1][1] is False
    drain(sched)
    ids = [ids for ids, _ in be.ahead]
    hinted = 0
    for k, (seq_ids, hint) in enumerate(be.ahead):
        if not hint:
            continue
        hinted += 1
        nxt = ids[k + 1] if k + 1 < len(ids) else ()
        gone = [owner[i] for i in seq_ids if i not in nxt]
        assert set(nxt) <= set(seq_ids), f"step {k}: hinted, then a new row joined ({nxt})"
        assert all(r.handle.result().finish_reason == "stop" for r in gone), f"step {k}: hinted, then {nxt}"
    assert hinted >= 10
    for r in (a, b):
        assert r.handle.result().token_ids == solo(r.prompt, r.params, 512)


def test_a_steps_prefill_chunks_go_in_one_call_and_a_failure_ends_only_its_request(tokenizer, rng):
    """Three prompts admitted in one step are prefilled by one prefill_many; when that call fails, each
    chunk is retried alone and only the request whose own prefill fails ends (with that error)."""
    be = PagedEcho(n_pages=40, max_context=256)
    sched = Scheduler(be, max_batch=4, prefill_chunk=512)
    reqs = [make_request(i, rng.integers(0, V, 10 + 5 * i).tolist(), params_for(6, None), tokenizer, 256)
            for i in range(3)]
    sched.waiting.extend(reqs)
    sched.step()
    assert ("prefill_many", 3) in be.calls and all(r.output for r in reqs)
    drain(sched)
    for r in reqs:
        assert r.handle.result().token_ids == solo(r.prompt, r.params, 256)

    be = PagedEcho(n_pages=40, max_context=256)
    sched = Scheduler(be, max_batch=4, prefill_chunk=512)
    boom = RuntimeError("chunk 1 fell over")
    real_prefill = be.prefill

    def prefill_many(items):
        raise RuntimeError("the batch fell over")

    def prefill(seq, ids, sampler):
        if len(ids) == 15:  # request 1's prompt
            raise boom
        return real_prefill(seq, ids, sampler)

    be.prefill_many, be.prefill = prefill_many, prefill
    reqs = [make_request(i, rng.integers(0, V, 10 + 5 * i).tolist(), params_for(6, None), tokenizer, 256)
            for i in range(3)]
    sched.waiting.extend(reqs)
    drain(sched)
    with pytest.raises(RuntimeError, match="chunk 1 fell over"):
        reqs[1].handle.result()
    for r in (reqs[0], reqs[2]):
        assert r.handle.result().token_ids == solo(r.prompt, r.params, 256)
    assert sched.counters.requests_failed == 1 and be.pool.n_free == be.pool.n_pages


def test_dry_pool_preempts_the_newest_and_it_recomputes_without_reemitting(tokenizer, rng):
    # 5 pages. a: 30-token prompt (2 pages), b: 31-token prompt (2 pages), 1 free. b reaches token 32
    # first and takes the last page; a's next step needs one more: b, the newest, is preempted, a runs
    # on; b comes back when a ends and finishes with its solo tokens.
    be = PagedEcho(n_pages=5, max_context=80)
    sched = Scheduler(be, max_batch=4, prefill_chunk=64)

    def full_length_prompt(n, params):
        # a prompt whose request runs all its 40 tokens: one that drew EOS early (a few percent of fresh prompts
        # do) would end before the pool runs dry, and nothing would be preempted
        while True:
            prompt = rng.integers(0, V, n).tolist()
            if len(solo(prompt, params, 80)) == params.max_tokens:
                return prompt

    pa, pb = params_for(40, 123), params_for(40, 456)
    a = make_request(0, full_length_prompt(30, pa), pa, tokenizer, 80)
    b = make_request(1, full_length_prompt(31, pb), pb, tokenizer, 80)
    sched.waiting.extend([a, b])
    preempted_at = None
    while sched.has_work():
        sched.step()
        check_pool(sched)
        if preempted_at is None and b.preemptions:
            preempted_at = len(b.output)
            assert a.preemptions == 0 and sched.waiting[0] is b and b.seq is None
    assert preempted_at is not None and sched.counters.preemptions >= 1
    for r in (a, b):
        got = r.handle.result().token_ids
        assert got == solo(r.prompt, r.params, 80)  # seeded draws survived the preemption
        assert len([e for e in r.handle]) == len(got)  # one event per token: nothing emitted twice
    assert be.pool.n_free == be.pool.n_pages


def test_head_of_line_waits_for_pages_and_max_batch_caps_running(tokenizer, rng):
    be = PagedEcho(n_pages=8, max_context=128)
    sched = Scheduler(be, max_batch=2, prefill_chunk=512)
    reqs = [make_request(i, rng.integers(0, V, n).tolist(), params_for(8, None), tokenizer, 128)
            for i, n in enumerate((70, 60, 3, 3))]  # 5 pages, 4 pages, then small ones
    sched.waiting.extend(reqs)
    sched.step()
    assert sched.running == [reqs[0]]  # 4 pages do not fit beside 5 of 8, and later ones do not overtake
    drain(sched)
    for r in reqs:
        assert r.handle.result().token_ids == solo(r.prompt, r.params, 128)
    assert max(b for k, b in be.calls if k == "decode") <= 2


# -- the state machine -----------------------------------------------------------------------------------

class SchedulerMachine(RuleBasedStateMachine):
    """Arrivals, cancellations and steps against small pools; the pool is checked after every step and
    every request's tokens against its solo run at the end. With open_ahead the backend takes pages
    ahead of the scheduler's reserve on run-ahead hints, as the CUDA backend does: the same tokens, the
    pool whole at the end, nothing stuck."""

    tokenizer = None  # set by the test below (a session fixture)
    sched: Scheduler | None = None  # set by setup (the first rule hypothesis runs)

    @initialize(n_pages=st.integers(3, 12), max_batch=st.integers(1, 5), chunk=st.integers(1, 48),
                ctx_pages=st.integers(2, 6), open_ahead=st.booleans())
    def setup(self, n_pages, max_batch, chunk, ctx_pages, open_ahead):
        self.max_context = min(ctx_pages, n_pages) * PAGE_TOKENS
        self.be = PagedEcho(n_pages, self.max_context, open_ahead)
        self.sched = Scheduler(self.be, max_batch=max_batch, prefill_chunk=chunk)
        self.reqs: list[Request] = []

    @rule(n=st.integers(1, 70), max_tokens=st.integers(1, 60), seed=st.one_of(st.none(), st.integers(0, 99)),
          prompt_seed=st.integers(0, 2**32 - 1))
    def submit(self, n, max_tokens, seed, prompt_seed):
        n = min(n, self.max_context)
        worst = min(n + max_tokens - 1, self.max_context)
        if pages_for(worst) > self.be.pool.n_pages:  # what Engine.submit refuses
            max_tokens = self.be.pool.n_pages * PAGE_TOKENS - n + 1
            if max_tokens < 1:
                return
        prompt = np.random.default_rng(prompt_seed).integers(0, V, n).tolist()
        r = make_request(len(self.reqs), prompt, params_for(max_tokens, seed), self.tokenizer, self.max_context)
        self.reqs.append(r)
        self.sched.waiting.append(r)

    @precondition(lambda self: any(not r.finished for r in self.reqs))
    @rule(data=st.data())
    def cancel(self, data):
        live = [r for r in self.reqs if not r.finished]
        data.draw(st.sampled_from(live)).handle.cancel()

    @rule(k=st.integers(1, 4))
    def step(self, k):
        for _ in range(k):
            self.sched.step()
            check_pool(self.sched)

    @invariant()
    def pool_consistent(self):
        if self.sched is not None:
            check_pool(self.sched)

    def teardown(self):
        if self.sched is None:
            return
        drain(self.sched)
        pool = self.be.pool
        assert pool_idle(pool)
        for r in self.reqs:
            assert r.finished
            res = r.handle.result()
            want = solo(r.prompt, r.params, self.max_context)
            if res.finish_reason == "cancelled":
                assert res.token_ids == want[: len(res.token_ids)]
            else:
                assert res.token_ids == want, (r.request_id, res.finish_reason)
                assert res.finish_reason == ("stop" if want[-1] == EOS else
                                             "length" if len(want) == r.params.max_tokens else "context")


def test_scheduler_state_machine(tokenizer):
    """Hypothesis draws its own seeds and, on a failure, prints the shrunk sequence of rules (and a
    @reproduce_failure blob) that replays it."""
    SchedulerMachine.tokenizer = tokenizer
    run_state_machine_as_test(SchedulerMachine, settings=settings(
        max_examples=150, stateful_step_count=40, deadline=None, database=None, print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))
