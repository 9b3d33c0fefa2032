"""CudaBackend's prefill, on the host stand-ins and on the GPU (cuda_testutil.py, the `kind` fixture): a
prompt in chunks gives the whole prompt's logits; prefill_many of several sequences gives their separate
prefills and is all or nothing; the resident fp16 prefill weights give the INT4 path's bits; the prefill
graphs (one per shape of pieces padded to buckets) give the eager pass's tokens and logits.
"""

from __future__ import annotations

import numpy as np
import pytest
from cuda_testutil import BATCH_INVARIANT, GREEDY, generate, make_backend, same_or_near_tie
from nanoqwen_engine.errors import InvalidRequestError, KVPagesExhaustedError
from nanoqwen_engine.sampler import SamplerState


def test_chunked_prefill_gives_the_whole_prefill(tied_path, kind, rng):
    """A prompt prefilled in chunks (each starting at seq.length, the sampler only with the last) gives
    the K/V and the logits of the one-piece prefill: the last chunk's logits equal the whole prefill's to
    rounding, and the continuation's tokens are the same (or first differ at a near-tie of the one-piece
    run's logits: the chunks sum in another order), with its last logits equal to rounding when they are.
    fp16 decode activations (BATCH_INVARIANT): the one-token chunk runs the B = 1 GEMVs, which with int8
    activations (the default) write its K/V from activations rounded to int8, and the one-piece prefill's
    GEMMs do not, so "equal to rounding" is fp16's property (with int8 the logits parted by 0.24 where the
    bound is 0.22, about one run in ten on the host stand-in, 2026-12-02)."""
    be = make_backend(tied_path, kind, max_context=128, **BATCH_INVARIANT)
    ids = rng.integers(0, be.config.vocab, size=53)
    whole_lg: list[np.ndarray] = []
    whole, s = generate(be, ids, 6, logits=whole_lg)
    be.pool.free(s)
    seq = be.pool.new_sequence()
    st = SamplerState(GREEDY, be.config.vocab)
    for a, b in ((0, 16), (16, 17), (17, 40)):  # page-aligned, one token, across a page boundary
        assert be.prefill(seq, ids[a:b], None) is None
        assert seq.length == b
    toks = [be.prefill(seq, ids[40:], st)]
    tol = 1e-2 * np.abs(whole_lg[0]).max()
    np.testing.assert_allclose(be.last_logits()[0], whole_lg[0], rtol=0, atol=tol)
    for _ in range(5):
        toks.append(be.decode([seq], [toks[-1]], [st])[0])
    same_or_near_tie(toks, whole, whole_lg, "chunked prefill", be)
    if toks == whole:
        np.testing.assert_allclose(be.last_logits()[0], whole_lg[-1], rtol=0, atol=1e-2 * np.abs(whole_lg[-1]).max())


@pytest.mark.parametrize("chunk", [4096, 24])
def test_prefill_many_is_the_separate_prefills(tied_path, kind, rng, monkeypatch, chunk):
    """prefill_many of 4 sequences (prompt lengths 1, 17, 30, 45; two of them starting mid-sequence after
    an earlier chunk; two sampled) gives what 4 separate prefill calls give: the same first ids, logits
    of the sampled rows equal to rounding (the rows share GEMMs of another M), and K/V that decode the
    same continuations. chunk = 24 makes the pass split segments into pieces and group pieces into
    passes (prefill.PREFILL_CHUNK). fp16 decode activations (BATCH_INVARIANT): separately, the 1-token
    prompt runs the B = 1 GEMVs, with int8 activations (the default) rounded to int8, and inside
    prefill_many the GEMMs, so with int8 its continuation may part at a gap within int8's noise (it did,
    on the host stand-in, 2026-12-02)."""
    from nanoqwen_engine.cuda import prefill as prefill_mod

    monkeypatch.setattr(prefill_mod, "PREFILL_CHUNK", chunk)
    be = make_backend(tied_path, kind, max_context=128, n_pages=64, **BATCH_INVARIANT)
    V = be.config.vocab
    heads = [0, 0, 11, 7]  # tokens prefilled before (no sampler) in a separate call
    lengths = [1, 17, 30, 45]
    sampled = [True, False, True, False]
    prompts = [rng.integers(0, V, size=h + n) for h, n in zip(heads, lengths, strict=True)]

    def run(together: bool):
        seqs = [be.pool.new_sequence() for _ in prompts]
        sts = [SamplerState(GREEDY, V) if smp else None for smp in sampled]
        for s, p, h in zip(seqs, prompts, heads, strict=True):
            if h:
                be.prefill(s, p[:h], None)
        items = [(s, p[h:], st) for s, p, h, st in zip(seqs, prompts, heads, sts, strict=True)]
        if together:
            firsts = be.prefill_many(items)
            logits = be.last_logits()
        else:
            firsts, rows = [], []
            for it in items:
                firsts.append(be.prefill(*it))
                if it[2] is not None:
                    rows.append(be.last_logits()[0])
            logits = np.stack(rows)
        assert [s.length for s in seqs] == [h + n for h, n in zip(heads, lengths, strict=True)]
        # 6 greedy steps of all four together, from their own first ids (the unsampled: their last prompt id)
        dec_st = [st or SamplerState(GREEDY, V) for st in sts]
        toks = [[f if f is not None else int(p[-1])] for f, p in zip(firsts, prompts, strict=True)]
        step_lg: list[list[np.ndarray]] = [[] for _ in prompts]  # each decoded token's logits, per row
        for _ in range(6):
            out = be.decode(seqs, [t[-1] for t in toks], dec_st)
            for b, (t, o) in enumerate(zip(toks, out, strict=True)):
                t.append(o)
                step_lg[b].append(be.last_logits()[b].copy())
        for s in seqs:
            be.pool.free(s)
        return firsts, logits, (toks, step_lg)

    f1, l1, (t1, lg1) = run(False)
    f2, l2, (t2, _) = run(True)
    assert [f is None for f in f2] == [not smp for smp in sampled]
    assert f1 == f2
    assert l2.shape == (2, V)
    np.testing.assert_allclose(l2, l1, rtol=0, atol=1e-2 * np.abs(l1).max())
    # the continuations: the same, or parted first at a near-tie of the separate run's logits (the rows'
    # prefill GEMMs of another M sum in another order; exact equality failed about one run in 40 on the
    # host stand-in, 2026-12-02)
    for row, (a, b, lg) in enumerate(zip(t1, t2, lg1, strict=True)):
        assert a[0] == b[0]
        same_or_near_tie(b[1:], a[1:], lg, f"prefill_many row {row}")
    assert be.pool.n_used == 0


def test_prefill_many_is_all_or_nothing(tied_path, kind, rng):
    """A prefill_many whose second sequence cannot have its pages: KVPagesExhaustedError, and the first
    sequence keeps its pages and length (nothing ran); bad input is refused before anything too."""
    be = make_backend(tied_path, kind, max_context=128, n_pages=4)
    a, b = be.pool.new_sequence(), be.pool.new_sequence()
    with pytest.raises(KVPagesExhaustedError):
        be.prefill_many([(a, rng.integers(0, 4096, 40), None), (b, rng.integers(0, 4096, 40), None)])
    assert (a.length, a.n_pages, b.length, b.n_pages, be.pool.n_free) == (0, 0, 0, 0, 4)
    with pytest.raises(InvalidRequestError, match="twice"):
        be.prefill_many([(a, [1, 2], None), (a, [3], None)])
    with pytest.raises(InvalidRequestError, match="out of range"):
        be.prefill_many([(a, [1, 2], None), (b, [4096], None)])
    assert be.pool.n_free == 4
    assert be.prefill_many([]) == []
    assert be.prefill_many([(a, [1, 2, 3], None), (b, [4, 5], None)]) == [None, None]
    assert (a.length, b.length) == (3, 2)


def test_resident_fp16_prefill_weights_give_the_int4_path_bits(tied_path, kind, rng, monkeypatch):
    """prefill_weights "fp16" (each matrix dequantized once at load, kept resident, cuBLAS) and "int4" (the
    fused INT4 GEMMs on the matrices as stored) multiply the same fp16 weight values; the int4 path's
    gate|up GEMM applies SiLU(gate) * up to the fp32 sums (the fp16 path rounds them to fp16 first) and,
    on the GPU, the GEMMs add in different orders: the logits agree to fp16 rounding of the activations
    and the greedy tokens are the same, prompts of 1 and 37 tokens; "auto" takes fp16 where it fits;
    $NANOQWEN_PREFILL_WEIGHTS is the default; a bad value is refused."""
    monkeypatch.delenv("NANOQWEN_PREFILL_WEIGHTS", raising=False)  # "auto" below must mean auto
    ids = rng.integers(0, 1000, size=37)
    logits, toks = {}, {}
    for mode in ("fp16", "int4"):
        be = make_backend(tied_path, kind, max_context=128, prefill_weights=mode)
        assert be.info["prefill_weights"] == mode
        assert (be.prefill_pass.dense is not None) == (mode == "fp16")
        out = []
        for n in (1, 37):
            seq = be.pool.new_sequence()
            out.append(be.prefill(seq, ids[:n], SamplerState(GREEDY, be.config.vocab)))
            out.append(be.last_logits()[0].copy())
            be.pool.free(seq)
        toks[mode], logits[mode] = out[0::2], out[1::2]
    assert toks["fp16"] == toks["int4"]
    for a, b in zip(logits["fp16"], logits["int4"], strict=True):
        assert np.abs(a - b).max() <= 2e-2 * max(1.0, np.abs(b).max())
        assert not np.array_equal(a, np.zeros_like(a))
    be = make_backend(tied_path, kind, max_context=128)  # auto: the tiny model's copy fits easily
    assert be.info["prefill_weights"] == "fp16" and be.info["prefill_dense_bytes"] > 0
    monkeypatch.setenv("NANOQWEN_PREFILL_WEIGHTS", "int4")
    assert make_backend(tied_path, kind, max_context=128).info["prefill_weights"] == "int4"
    with pytest.raises(InvalidRequestError, match="prefill_weights"):
        make_backend(tied_path, kind, max_context=128, prefill_weights="bf16")


def test_fp8_prefill_rounds_only_the_activations(tied_path, kind, rng):
    """prefill_weights "fp8" (opt-in): each GEMM's X rounded to e4m3 with a scale per token, the weights'
    e4m3 copy exact. Its logits stay near the fp16 path's (the rounding is ~2^-4 relative per activation), a
    chunked fp8 prefill gives the whole one's (the rounding is per token row, so the chunks do not change
    it), and decoding continues from its K/V. "auto" never picks it."""
    ids = rng.integers(0, 1000, size=37)
    ref = make_backend(tied_path, kind, max_context=128, prefill_weights="int4")
    be = make_backend(tied_path, kind, max_context=128, prefill_weights="fp8")
    assert be.info["prefill_weights"] == "fp8" and be.info["prefill_fp8_bytes"] > 0
    assert be.prefill_pass.fp8 is not None and be.prefill_pass.dense is None
    for n in (1, 37):
        got = []
        for b in (ref, be):
            seq = b.pool.new_sequence()
            b.prefill(seq, ids[:n], SamplerState(GREEDY, b.config.vocab))
            got.append(b.last_logits()[0].copy())
            b.pool.free(seq)
        a, f = got
        assert not np.array_equal(a, f)  # the activations were rounded
        assert np.abs(a - f).max() <= 0.15 * np.abs(a).max()
        assert np.corrcoef(a, f)[0, 1] > 0.99
    whole, s = generate(be, ids, 4)
    whole_logits = be.last_logits()
    be.pool.free(s)
    seq = be.pool.new_sequence()
    st = SamplerState(GREEDY, be.config.vocab)
    be.prefill(seq, ids[:20], None)
    toks = [be.prefill(seq, ids[20:], st)]
    for _ in range(3):
        toks.append(be.decode([seq], [toks[-1]], [st])[0])
    assert toks == whole
    np.testing.assert_allclose(be.last_logits(), whole_logits, rtol=0, atol=2e-2 * np.abs(whole_logits).max())


def test_a_prompt_gets_the_same_logits_first_and_later(tied_path, kind, rng):
    """With prefill graphs on, a backend's first prompt goes through its bucket's shape as every later one does
    (eagerly on the shape's first use, then captured and replayed), so the same prompt gives the same logits
    bit for bit on its first, second and third prefill, and so the same tokens. (The first pass once ran at its
    own row count, and its GEMMs rounded differently: a near-tie could part the first answer from later ones.)"""
    be = make_backend(tied_path, kind, max_context=64)
    assert be.prefill_pass.graphs
    ids = rng.integers(0, be.config.vocab, size=int(rng.integers(2, 40)))
    runs = []
    for _ in range(3):
        logits: list = []
        toks, seq = generate(be, ids, 3, logits=logits)
        be.pool.free(seq)
        runs.append((toks, logits[0]))
    for toks, first in runs[1:]:
        assert first.tobytes() == runs[0][1].tobytes()
        assert toks == runs[0][0]


@pytest.mark.parametrize("weights", ["auto", "fp8"])
def test_prefill_graphs_replay_the_eager_pass(tied_path, kind, rng, weights):
    """One sequence's prefill of <= 512 tokens replays the captured pass of its bucket (after the first
    pass, eager): the same next token and logits as the eager pass (graphs off), for prompts of several
    lengths within a bucket and across buckets, from position 0 and mid-sequence (a second chunk), and
    the K/V it leaves decodes the same tokens; with the default prefill weights and the FP8 path."""
    graph = make_backend(tied_path, kind, max_context=128, prefill_weights=weights)
    eager = make_backend(tied_path, kind, max_context=128, decode_mode="eager", prefill_weights=weights)
    assert graph.prefill_pass.graphs and not eager.prefill_pass.graphs
    V = graph.config.vocab
    for n in (5, 9, 16, 3, 40, 17, 33, 12):
        ids = rng.integers(0, V, size=n)
        split = n // 3  # a first chunk without a sampler, then the rest from position `split`
        got = []
        for be in (graph, eager):
            seq = be.pool.new_sequence()
            st = SamplerState(GREEDY, V)
            if split:
                assert be.prefill(seq, ids[:split], None) is None
            toks = [be.prefill(seq, ids[split:], st)]
            logits = [be.last_logits()[0].copy()]
            for _ in range(3):
                toks.append(be.decode([seq], [toks[-1]], [st])[0])
                logits.append(be.last_logits()[0].copy())
            be.pool.free(seq)
            got.append((toks, logits))
        (gt, gl), (et, el) = got
        np.testing.assert_allclose(gl[0], el[0], rtol=0, atol=2e-2 * np.abs(el[0]).max())
        same_or_near_tie(gt, et, el, f"prompt of {n}", graph)
    shapes = {k[0] for k, g in graph.prefill_pass._graphs.items() if g.graph is not None}
    assert {(16,), (32,)} <= shapes <= {(16,), (32,), (64,)}  # the chunks: 1..13 and 2..27 tokens


def test_prefill_many_graphs_replay_the_eager_pass(tied_path, kind, rng):
    """prefill_many of several sequences (each padded to its bucket, GRAPH_MAX_ROWS rows in all) runs a
    shape's launches eagerly in the graph buffers on its first use, captures them on the second and
    replays them after: each sequence's next token and logits as the eager pass (graphs off) every time,
    with other prompts and positions each round, for two shapes, and a pass too large for a graph."""
    from nanoqwen_engine.cuda.prefill import GRAPH_MAX_ROWS

    graph = make_backend(tied_path, kind, max_context=256, n_pages=64)
    eager = make_backend(tied_path, kind, max_context=256, n_pages=64, decode_mode="eager")
    V = graph.config.vocab
    # shapes (16, 32, 32) and (16, 64) three times each; the last: 128 + 256 + 192 rows > 512
    rounds = [[5, 30, 17], [12, 20, 31], [3, 29, 22], [3, 64], [9, 50], [1, 33], [100, 200, 150]]
    assert sum([128, 256, 192]) > GRAPH_MAX_ROWS
    for lengths in rounds:
        lead = [int(rng.integers(0, 20)) for _ in lengths]  # tokens each sequence holds already
        prompts = [rng.integers(0, V, size=n) for n in lengths]
        pre = [rng.integers(0, V, size=m) for m in lead]
        got = []
        for be in (graph, eager):
            seqs = [be.pool.new_sequence() for _ in lengths]
            for s, p in zip(seqs, pre, strict=True):
                if len(p):
                    be.prefill(s, p, None)
            sts = [SamplerState(GREEDY, V) for _ in lengths]
            toks = be.prefill_many(list(zip(seqs, prompts, sts, strict=True)))
            got.append((toks, be.last_logits().copy()))
            for s in seqs:
                be.pool.free(s)
        (gt, gl), (et, el) = got
        np.testing.assert_allclose(gl, el, rtol=0, atol=2e-2 * np.abs(el).max())
        for j in range(len(lengths)):
            same_or_near_tie([gt[j]], [et[j]], [el[j]], f"round {lengths}, sequence {j}", graph)
    shapes = {k[0] for k, g in graph.prefill_pass._graphs.items() if g.graph is not None}
    assert shapes == {(16, 32, 32), (16, 64)} | (shapes & {(16,), (32,)})  # + the lead prompts' shapes
    assert all(g.uses == 3 for k, g in graph.prefill_pass._graphs.items() if len(k[0]) > 1)


def test_a_short_call_goes_in_graph_sized_passes(tied_path, kind, rng, monkeypatch):
    """prefill.GRAPH_SPLIT_MAX_ROWS: with graphs on, a call of at most that many rows in all is cut into
    passes of GRAPH_MAX_ROWS (each replayable), a longer one into passes of PREFILL_CHUNK; graphs off,
    PREFILL_CHUNK always. (Scaled down: 16-row graphs, calls of <= 32 rows split.) The first tokens and
    the continuations are the eager backend's."""
    from nanoqwen_engine.cuda import prefill as prefill_mod

    monkeypatch.setattr(prefill_mod, "GRAPH_BUCKETS", (16,))
    monkeypatch.setattr(prefill_mod, "GRAPH_MAX_ROWS", 16)
    monkeypatch.setattr(prefill_mod, "GRAPH_SPLIT_MAX_ROWS", 32)
    graph = make_backend(tied_path, kind, max_context=128)
    eager = make_backend(tied_path, kind, max_context=128, decode_mode="eager")
    V = graph.config.vocab
    for n, want in ((30, [16, 14]), (40, [40])):
        ids = rng.integers(0, V, size=n)
        got = []
        for be in (graph, eager):
            sizes = []
            orig = be.prefill_pass._pass

            def spy(pieces, orig=orig, sizes=sizes):
                sizes.append(sum(int(p[0].shape[0]) for p in pieces))
                return orig(pieces)

            monkeypatch.setattr(be.prefill_pass, "_pass", spy)
            seq = be.pool.new_sequence()
            st = SamplerState(GREEDY, V)
            toks = [be.prefill(seq, ids, st)]
            logits = [be.last_logits()[0].copy()]
            for _ in range(3):
                toks.append(be.decode([seq], [toks[-1]], [st])[0])
                logits.append(be.last_logits()[0].copy())
            be.pool.free(seq)
            got.append((toks, logits, sizes))
        (gt, _, gsizes), (et, el, esizes) = got
        assert gsizes == want and esizes == [n], (n, gsizes, esizes)
        same_or_near_tie(gt, et, el, f"prompt of {n}", graph)
