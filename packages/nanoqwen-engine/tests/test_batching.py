"""Continuous batching with the real model (the CPU reference backend, tied test model): a sequence in a
batch yields the tokens and logits it yields alone, whatever runs beside it, arrives, leaves, is
cancelled or preempted, and however its prompt is chunked."""

from __future__ import annotations

import numpy as np
import pytest
from engine_testutil import pool_idle
from nanoqwen_engine import Engine, SamplingParams
from nanoqwen_engine.reference import ReferenceBackend
from nanoqwen_engine.sampler import SamplerState

GREEDY = SamplingParams(temperature=0).resolve({})
BOUNDARY_LENGTHS = (1, 15, 16, 17, 31, 32, 33)  # prompts whose decode crosses a page at different steps


def rel_close(got, want, tol=1e-4):
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())


@pytest.fixture
def backend(tied_path, open_file):
    nq, cfg = open_file(tied_path)
    return ReferenceBackend.create(nq, cfg, max_context=128, n_pages=64)


def test_decode_rows_equal_each_sequence_alone(backend, rng):
    """B = 7 sequences of the page-boundary lengths decode 20 steps together: every row's logits equal
    that sequence's logits decoded alone, and greedy picks the same ids."""
    V = backend.config.vocab
    prompts = [rng.integers(0, V, n) for n in BOUNDARY_LENGTHS]
    alone = []
    for p in prompts:
        seq, s = backend.pool.new_sequence(), SamplerState(GREEDY, V)
        toks, rows = [backend.prefill(seq, p, s)], []
        for _ in range(20):
            toks.append(backend.decode([seq], [toks[-1]], [s])[0])
            rows.append(backend.last_logits()[0].copy())
        alone.append((toks, np.stack(rows)))
        backend.pool.free(seq)
    seqs = [backend.pool.new_sequence() for _ in prompts]
    samplers = [SamplerState(GREEDY, V) for _ in prompts]
    toks = [[backend.prefill(q, p, s)] for q, p, s in zip(seqs, prompts, samplers, strict=True)]
    rows = []
    for _ in range(20):
        out = backend.decode(seqs, [t[-1] for t in toks], samplers)
        assert backend.last_logits().shape == (len(seqs), V)
        rows.append(backend.last_logits().copy())
        for t, o in zip(toks, out, strict=True):
            t.append(o)
    batched = np.stack(rows, axis=1)  # [B, steps, V]
    for b, (a_toks, a_rows) in enumerate(alone):
        assert toks[b] == a_toks, f"prompt of {BOUNDARY_LENGTHS[b]} tokens"
        rel_close(batched[b], a_rows)
    for q, n in zip(seqs, BOUNDARY_LENGTHS, strict=True):
        assert q.length == n + 20
        backend.pool.free(q)
    assert pool_idle(backend.pool)


def test_chunked_prefill_gives_the_logits_and_cache_of_one_piece(backend, rng):
    V = backend.config.vocab
    ids = rng.integers(0, V, 50)
    whole = backend.score(ids)
    seq = backend.pool.new_sequence()
    for a, b in ((0, 1), (1, 16), (16, 17), (17, 40)):
        assert backend.prefill(seq, ids[a:b], None) is None
        assert seq.length == b
        rel_close(backend.last_logits()[0], whole[b - 1])
    tok = backend.prefill(seq, ids[40:], SamplerState(GREEDY, V))
    assert backend.last_logits().shape == (1, V)
    rel_close(backend.last_logits()[0], whole[-1])
    assert tok == int(np.argmax(whole[-1]))
    # the cache the chunks wrote serves the next decode as one prefill's would
    nxt = backend.decode([seq], [tok], [SamplerState(GREEDY, V)])[0]
    rel_close(backend.last_logits()[0], backend.score(np.append(ids, tok))[-1])
    assert nxt == int(np.argmax(backend.last_logits()[0]))
    backend.pool.free(seq)


def test_decode_batch_is_all_or_nothing_when_the_pool_is_short(tied_path, open_file, rng):
    from nanoqwen_engine import KVPagesExhaustedError

    nq, cfg = open_file(tied_path)
    be = ReferenceBackend.create(nq, cfg, max_context=64, n_pages=3)
    a, b = be.pool.new_sequence(), be.pool.new_sequence()
    be.prefill(a, rng.integers(0, 4096, 16), None)  # 1 page, full: the next token needs a second
    be.prefill(b, rng.integers(0, 4096, 20), None)  # 2 pages: none free
    before = (a.length, b.length, a.pages().tolist(), b.pages().tolist(), be.pool.n_free)
    with pytest.raises(KVPagesExhaustedError):
        be.decode([b, a], [1, 2], [SamplerState(GREEDY, 4096)] * 2)
    assert (a.length, b.length, a.pages().tolist(), b.pages().tolist(), be.pool.n_free) == before


@pytest.fixture
def engine_factory(tied_path):
    made = []

    def make(**kw):
        kw = {"max_context": 128, "kv_pages": 64, **kw}
        e = Engine.load(tied_path, device="cpu", progress=False, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def test_engine_batch_with_arrivals_and_cancellations_mid_flight(engine_factory, rng):
    engine = engine_factory()
    prompts = [rng.integers(0, 4096, n).tolist() for n in BOUNDARY_LENGTHS]
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (20, 9, 25, 14, 30, 5, 18)]
    solo = [engine.complete(p, q).token_ids for p, q in zip(prompts, params, strict=True)]
    first = [engine.submit(p, q) for p, q in zip(prompts[:4], params[:4], strict=True)]
    it0 = iter(first[0])
    got0 = [next(it0).token_id for _ in range(3)]
    late = [engine.submit(p, q) for p, q in zip(prompts[4:], params[4:], strict=True)]  # arrive mid-flight
    it2 = iter(first[2])
    got2 = [next(it2).token_id for _ in range(2)]
    first[2].cancel()
    got0 += [e.token_id for e in it0]
    assert got0 == solo[0]
    for i, h in enumerate(first + late):
        r = h.result()
        if i == 2:
            assert r.finish_reason == "cancelled" and r.token_ids == solo[2][: len(r.token_ids)]
            assert r.token_ids[:2] == got2
        else:
            assert r.token_ids == solo[i], f"request {i} ({BOUNDARY_LENGTHS[i]}-token prompt)"
    assert pool_idle(engine.backend.pool)
    assert engine.stats()["decode_rows"] > engine.stats()["steps"]


def test_small_prefill_chunks_give_the_same_tokens(engine_factory, rng):
    prompts = [rng.integers(0, 4096, n).tolist() for n in (70, 3, 45)]
    params = SamplingParams(temperature=0, max_tokens=12)
    whole = engine_factory(prefill_chunk=512)
    want = [h.result().token_ids for h in [whole.submit(p, params) for p in prompts]]
    chunked = engine_factory(prefill_chunk=7, prefill_chunk_idle=7)
    got = [h.result().token_ids for h in [chunked.submit(p, params) for p in prompts]]
    assert got == want
    s = chunked.stats()
    assert s["prefill_tokens"] == sum(len(p) for p in prompts) and s["steps"] >= 118 // 7
    assert s["prefill_chunk"] == s["prefill_chunk_idle"] == 7


def test_preempted_requests_recompute_and_give_their_solo_tokens(engine_factory, rng):
    """6 pages for 3 requests that each grow to 4: the pool runs dry mid-generation, the newest are
    preempted and recomputed; greedy and seeded requests alike end with their solo tokens."""
    engine = engine_factory(max_context=96, kv_pages=6)
    prompts = [rng.integers(0, 4096, n).tolist() for n in (20, 24, 30)]
    params = [SamplingParams(temperature=0, max_tokens=34), SamplingParams(temperature=0.9, seed=5, max_tokens=30),
              SamplingParams(temperature=0, max_tokens=26)]
    solo = [engine.complete(p, q).token_ids for p, q in zip(prompts, params, strict=True)]
    handles = [engine.submit(p, q) for p, q in zip(prompts, params, strict=True)]
    events = [[e.token_id for e in h] for h in handles]
    assert events == solo  # nothing emitted twice, nothing lost
    assert engine.stats()["preemptions"] >= 1
    assert sum(h.result().stats["preemptions"] for h in handles) == engine.stats()["preemptions"]
    assert pool_idle(engine.backend.pool)


def test_seeded_sampling_in_a_batch_equals_alone(engine_factory, rng):
    engine = engine_factory()
    prompts = [rng.integers(0, 4096, n).tolist() for n in (5, 17, 30)]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=15) for s in (1, 2, 3)]
    solo = [engine.complete(p, q).token_ids for p, q in zip(prompts, params, strict=True)]
    handles = [engine.submit(p, q) for p, q in zip(prompts, params, strict=True)]
    assert [h.result().token_ids for h in handles] == solo


def test_idle_prefill_budget_defaults_to_the_backends(engine_factory):
    """prefill_chunk_idle=None takes the backend's (the CPU reference has none: prefill_chunk; the GPU
    backend's is CudaBackend.PREFILL_CHUNK_IDLE); a value below prefill_chunk is raised to it."""
    from nanoqwen_engine.cuda.backend import CudaBackend

    assert CudaBackend.PREFILL_CHUNK_IDLE >= 512
    assert engine_factory().stats()["prefill_chunk_idle"] == 512
    assert engine_factory(prefill_chunk=32).stats()["prefill_chunk_idle"] == 32
    assert engine_factory(prefill_chunk=32, prefill_chunk_idle=96).stats()["prefill_chunk_idle"] == 96
    assert engine_factory(prefill_chunk=32, prefill_chunk_idle=8).stats()["prefill_chunk_idle"] == 32
