"""CudaBackend's plumbing, on the CPU with numpy stand-ins for the GPU and kernels, and on the GPU.

device.HostDevice replaces CuPy (its "graph" records launcher calls at capture and replays them, freezing
Python scalars like a CUDA graph), host_kernels.HostKernels replaces the compiled KernelSet. What this
proves without a GPU: the right buffers, layers, positions and page tables reach every launcher for every
row of a batch; each sequence of a batch gets the tokens it gets alone; a bucket's graph is captured once
and replayed as sequences join, leave and cross page boundaries; errors leave the backend usable. Every
test also runs with kind="gpu" (the real CupyDevice and KernelSet; marked gpu, skipped without one). The
kernels' numerical agreement with the reference is the ladder's job (tests/ at the root).

Greedy tokens of a sequence alone and inside a batch are compared exactly, except at a near-tie
(cuda_testutil.NEAR_TIE). Prefill (chunks, several sequences at once, the prefill weights, the prefill
graphs) is test_cuda_prefill.py's.
"""

from __future__ import annotations

import numpy as np
import pytest
from cuda_testutil import (
    BATCH_INVARIANT,
    GREEDY,
    generate,
    make_backend,
    near_tie,
    open_file,
    run_alone,
    same_or_near_tie,
)
from nanoqwen_engine.cuda import CudaBackend
from nanoqwen_engine.errors import InvalidRequestError, KVPagesExhaustedError
from nanoqwen_engine.kv_pages import pages_for
from nanoqwen_engine.params import SamplingParams
from nanoqwen_engine.reference import ReferenceBackend
from nanoqwen_engine.sampler import SamplerState


@pytest.fixture
def tied_pair(tied_path, kind):
    nq, cfg = open_file(tied_path)
    ref = ReferenceBackend.create(nq, cfg, max_context=128)
    return make_backend(tied_path, kind, max_context=128), ref


def test_greedy_matches_reference_across_page_boundaries(tied_pair, rng):
    """The GPU path's greedy tokens, teacher-forced through the reference (one score() of prompt + tokens):
    each is the reference's argmax at its position, or a near-tie of the reference's own logits: a relative
    gap under NEAR_TIE with fp16 decode activations; with int8 (the default) a gap under validation.EPS["int8"]
    logits, int8's measured rounding noise (the relative bound of 2e-3 failed int8 once on the H200 with a
    fresh prompt, 2026-12-02, and passed the runs before and after: a bound below int8's noise)."""
    gpu, ref = tied_pair
    V = gpu.config.vocab
    for length in (1, 15, 16, 17, 31, 33):
        ids = rng.integers(0, V, size=length)
        a, sa = generate(gpu, ids, 20)
        assert sa.length == length + 19
        gpu.pool.free(sa)
        want = ref.score(np.concatenate([ids, a[:-1]]))[length - 1:]  # [20, V]: the logits each token came from
        for i, row in enumerate(want):
            if a[i] != int(np.argmax(row)):
                ok, gap = near_tie(gpu, row, a[i])
                assert ok, f"prompt of {length}: token {i} is {a[i]}, the reference's argmax " \
                           f"{int(np.argmax(row))} by a gap of {gap:.3g} ({gpu.info.get('decode_activations')})"
    # the batch-1 greedy graph captured once, replayed across every boundary above
    assert list(gpu.step.graphs) == [(1, "greedy")]


def test_last_logits_and_score_match_reference(tied_pair, rng):
    gpu, ref = tied_pair
    ids = rng.integers(0, gpu.config.vocab, size=37)
    a, b = gpu.score(ids), ref.score(ids)
    assert a.shape == b.shape == (37, gpu.config.vocab)
    rel = np.linalg.norm(a - b) / np.linalg.norm(b)
    assert rel < 1e-2, rel  # fp16 storage of activations and KV vs float32: ~1e-3
    assert gpu.pool.n_used == 0  # score's temporary sequence is freed
    _, seq = generate(gpu, ids[:5], 1)
    last = gpu.last_logits()
    assert last.shape == (1, gpu.config.vocab)
    np.testing.assert_allclose(last[0], a[4], rtol=0, atol=0.05 * np.abs(a[4]).max())
    gpu.pool.free(seq)


def test_graph_and_eager_give_the_same_tokens(tied_path, kind, rng):
    ids = rng.integers(0, 4096, size=20)
    g = make_backend(tied_path, kind, "graph", max_context=64)
    e = make_backend(tied_path, kind, "eager", max_context=64)
    assert generate(g, ids, 24)[0] == generate(e, ids, 24)[0]
    assert e.step.graphs == {}
    c = g.config
    # embed + 5 per layer + final norm, lm_head, sampler, advance
    calls = 1 + 5 * c.n_layers + 4
    assert g.info["launcher_calls_per_token"] == calls
    nodes = g.info["graph_kernel_nodes_greedy"]
    if kind == "host":
        assert nodes == calls
    else:  # a launcher may be several kernels (split attention + combine); None if the dump is unreadable
        assert nodes is None or nodes >= calls


class _Names:
    """A kernel set that only records which launchers are called (and what its attributes are asked)."""

    def __init__(self):
        self.called: set[str] = set()

    def __getattr__(self, name):
        if name in ("gemv_variant", "a8_image_pair"):
            return None
        return lambda *a, **k: self.called.add(name)


def _never_then_from_30(tied_path, kind, ids, monkeypatch, env: str) -> list:
    """24 greedy tokens of prompt `ids` on a backend built with $env=0 (the range never taken) and on one built
    with $env=30: [that backend, its tokens, its logits] for each, in that order."""
    runs: list = []
    for value in ("0", "30"):
        monkeypatch.setenv(env, value)
        be = make_backend(tied_path, kind, max_context=64)
        logits: list[np.ndarray] = []
        runs += [be, generate(be, ids, 24, logits=logits)[0], logits]
    return runs


def test_long_context_steps_take_their_own_graph(tied_path, kind, rng, monkeypatch):
    """From NANOQWEN_DECODE_LONG_CONTEXT tokens on (here 30, the 7B's default being 8,192) a step launches
    decode attention's long-context build from a graph of its own; the tokens are those of a backend that
    never does (or differ first at a near-tie: on the GPU the long build splits the pages differently)."""
    ids = rng.integers(0, 4096, size=20)
    never, want, want_logits, long, got, _ = _never_then_from_30(tied_path, kind, ids, monkeypatch,
                                                                 "NANOQWEN_DECODE_LONG_CONTEXT")
    assert set(never.step.graphs) == {(1, "greedy")}
    same_or_near_tie(got, want, want_logits, "long-context graph", be=never)
    # steps up to 29 tokens replay the default graph, the later ones the long one (each captured once)
    assert set(long.step.graphs) == {(1, "greedy"), (1, "greedy@long")}
    assert long.info["graph_kernel_nodes_greedy@long"] == long.info["graph_kernel_nodes_greedy"]
    if kind == "host":  # the long build ran for the layers of the steps from 30 tokens on (20 + 23 steps)
        assert long.ks.long_calls == (20 + 23 - 29) * long.config.n_layers
    monkeypatch.setenv("NANOQWEN_DECODE_LONG_CONTEXT", "many")
    with pytest.raises(ValueError, match="NANOQWEN_DECODE_LONG_CONTEXT"):
        make_backend(tied_path, kind, max_context=64)


def test_short_context_steps_take_the_one_cluster_grid(tied_path, kind, rng, monkeypatch):
    """Up to NANOQWEN_DECODE_SHORT_CONTEXT tokens (here 30, the default 1,024) a step launches decode
    attention on one cluster per sequence from the plain mode's graph, past it the default grid from a
    "@mid" graph. At these lengths both grids read every page with the first cluster alone, so the logits are
    the same bits as a backend's that never takes the short grid, on the GPU too."""
    ids = rng.integers(0, 4096, size=20)
    never, want, want_logits, short, got, got_logits = _never_then_from_30(tied_path, kind, ids, monkeypatch,
                                                                           "NANOQWEN_DECODE_SHORT_CONTEXT")
    assert set(never.step.graphs) == {(1, "greedy@mid")}
    assert got == want
    for a, b in zip(got_logits, want_logits, strict=True):
        np.testing.assert_array_equal(a, b)
    # steps whose sequence holds up to 30 tokens (its new one included) replay the plain graph, the later
    # ones the "@mid" graph, each captured once
    assert set(short.step.graphs) == {(1, "greedy"), (1, "greedy@mid")}
    assert short.step.context_span(30) == "" and short.step.context_span(31) == "@mid"
    if kind == "host":  # the short grid ran for the steps of 21..30 tokens (10 steps), the rest on the default
        assert short.ks.short_calls == 10 * short.config.n_layers
    # the short-context GEMV build changes only the batch-1 loop: a batch's short step launches the default one
    for rows, want, not_these in ((1, {"qkv_rope_kv_short", "gate_up_silu_short"}, {"qkv_rope_kv", "gate_up_silu"}),
                                  (2, {"qkv_rope_kv", "gate_up_silu"}, {"qkv_rope_kv_short", "gate_up_silu_short"})):
        named = _Names()
        short.step.launch_layer(named, 0, short.step.views(rows), "")
        assert want | {"attention_decode_short"} <= named.called and not named.called & not_these, rows
    monkeypatch.setenv("NANOQWEN_DECODE_SHORT_CONTEXT", "-3")
    with pytest.raises(ValueError, match="NANOQWEN_DECODE_SHORT_CONTEXT"):
        make_backend(tied_path, kind, max_context=64)


def test_int8_decode_activations_round_only_batch1_decode(tied_path, kind, rng):
    """decode_activations="int8" (the default; the GEMV variant "a8"): a single sequence's decode GEMVs
    multiply the activation rounded to int8 per 16 values. Teacher-forced on the fp16 run's tokens: the prefill's
    logits are the same bits (prefill is not touched), every decode step's logits differ (the rounding is
    there) by a small part of the logits' range."""
    ref = make_backend(tied_path, kind, max_context=96, decode_activations="fp16")
    a8 = make_backend(tied_path, kind, max_context=96)
    assert ref.info["decode_activations"] == "fp16" and a8.info["decode_activations"] == "int8"
    ids = rng.integers(0, ref.config.vocab, size=21)
    want_logits: list[np.ndarray] = []
    toks, _ = generate(ref, ids, 10, logits=want_logits)
    seq = a8.pool.new_sequence()
    st = SamplerState(GREEDY, a8.config.vocab)
    a8.prefill(seq, np.asarray(ids), st)
    assert np.array_equal(a8.last_logits()[0], want_logits[0])
    for t, want in zip(toks[:-1], want_logits[1:], strict=True):  # the fp16 run's token as each input
        a8.decode([seq], [t], [st])
        got = a8.last_logits()[0]
        diff = float(np.abs(got - want).max())
        assert 0 < diff < 0.05 * float(want.max() - want.min()), diff


def test_int8_decode_activations_need_the_a8_kernels(tied_path):
    """A kernel stand-in built without the int8-activation loop is refused for decode_activations="int8",
    and an unknown setting is named."""
    from nanoqwen_engine.cuda.device import HostDevice
    from nanoqwen_engine.cuda.host_kernels import HostKernels

    nq, cfg = open_file(tied_path)
    dev = HostDevice()
    with pytest.raises(InvalidRequestError, match="GEMV variant 'a8'"):
        CudaBackend.create(nq, cfg, progress=False, device=dev, kernels=HostKernels(cfg, dev),
                           decode_activations="int8")
    with pytest.raises(InvalidRequestError, match="decode_activations"):
        make_backend(tied_path, "host", decode_activations="int4")


def test_decode_activations_default_to_int8_unless_a_variant_is_named():
    """Who decides what batch-1 decode GEMVs multiply: an explicit setting (argument or
    $NANOQWEN_DECODE_ACTIVATIONS) wins; else a kernel stand-in's or $NANOQWEN_GEMV_VARIANT's variant says;
    else DEFAULT_DECODE_ACTIVATIONS (int8: the GEMV variant "a8"). fp16 never builds "a8", even when
    $NANOQWEN_GEMV_VARIANT names it, and names the kernels' default variant rather than leaving the choice
    to that variable."""
    from types import SimpleNamespace

    from nanoqwen_engine.cuda.load import (
        DEFAULT_DECODE_ACTIVATIONS,
        FP16_GEMV_VARIANT,
        decode_activations_plan,
    )
    from nanoqwen_kernels.gemv import A8_VARIANTS, DEFAULT_GEMV_VARIANT

    assert FP16_GEMV_VARIANT == DEFAULT_GEMV_VARIANT and FP16_GEMV_VARIANT not in A8_VARIANTS
    assert DEFAULT_DECODE_ACTIVATIONS == "int8"
    assert decode_activations_plan(None, None) == ("int8", "a8")
    assert decode_activations_plan("int8", None) == ("int8", "a8")
    assert decode_activations_plan("fp16", None) == ("fp16", "tiles")
    assert decode_activations_plan("fp16", "mma") == ("fp16", "mma")
    assert decode_activations_plan("fp16", "a8") == ("fp16", "tiles")
    assert decode_activations_plan("int8", "mma") == ("int8", "a8")
    assert decode_activations_plan(None, "mma") == ("fp16", "mma")
    assert decode_activations_plan(None, "a8") == ("int8", "a8")
    assert decode_activations_plan(None, None, SimpleNamespace(gemv_variant="tiles")) == ("fp16", "tiles")
    assert decode_activations_plan(None, "mma", SimpleNamespace(gemv_variant="a8")) == ("int8", "a8")
    assert decode_activations_plan(None, None, object()) == ("fp16", None)  # a stand-in with no variant


def test_each_row_of_a_batch_gets_its_tokens_alone(model_path, kind, rng):
    """6 sequences of mixed prompt lengths decode together: page boundaries fall at different steps for
    different rows (steps 0, 1, 8, ...); each row's greedy tokens are the ones it gets alone. Both test
    models: the tied one (4 heads / 2 KV heads, vocab 4096) and the tiny one (GQA 2, vocab 152064)."""
    be = make_backend(model_path, kind, max_context=96, n_pages=64, **BATCH_INVARIANT)
    lengths = [1, 15, 16, 17, 31, 40]
    prompts = [rng.integers(0, be.config.vocab, size=n) for n in lengths]
    n = 12
    alone = run_alone(be, prompts, n)
    seqs = [be.pool.new_sequence() for _ in prompts]
    sts = [SamplerState(GREEDY, be.config.vocab) for _ in prompts]
    toks = [[be.prefill(s, p, st)] for s, p, st in zip(seqs, prompts, sts, strict=True)]
    for _ in range(n - 1):
        out = be.decode(seqs, [t[-1] for t in toks], sts)
        for t, o in zip(toks, out, strict=True):
            t.append(o)
    for b, (t, (want, lg)) in enumerate(zip(toks, alone, strict=True)):
        same_or_near_tie(t, want, lg, f"row {b} (prompt of {lengths[b]})")
        assert seqs[b].length == lengths[b] + n - 1
    assert set(be.step.graphs) == {(1, "greedy"), (8, "greedy")}
    assert be.last_logits().shape == (6, be.config.vocab)


@pytest.mark.parametrize("run_ahead", [False, True])
def test_buckets_replay_as_the_batch_changes(tied_path, kind, rng, run_ahead):
    """Sequences join and leave between steps (B = 1, 3, 3, 6, 6, 2, 2, 5, 1, 1 ...): rows are reassigned,
    idle rows padded, each bucket's graph captured once and replayed; every sequence still gets its
    tokens alone, and the pool gets all its pages back. With run_ahead on every call (the hint wrong
    whenever the batch changes, new prompts prefilled while a step runs ahead), the same tokens: a step
    run ahead serves the next call when it is the same batch and is discarded otherwise."""
    be = make_backend(tied_path, kind, max_context=96, max_batch=8, n_pages=64, **BATCH_INVARIANT)
    V = be.config.vocab
    # (start step, number of tokens) per sequence
    plan = [(0, 14), (1, 6), (1, 9), (3, 10), (3, 3), (3, 8), (6, 7), (7, 5)]
    prompts = [rng.integers(0, V, size=int(rng.integers(1, 35))) for _ in plan]
    alone = run_alone(be, prompts, max(n for _, n in plan))
    live: dict[int, tuple] = {}  # index -> (seq, sampler, tokens)
    done: dict[int, list[int]] = {}
    batch_sizes = []
    for step in range(40):
        for i, (t0, _) in enumerate(plan):
            if t0 == step:
                s, st = be.pool.new_sequence(), SamplerState(GREEDY, V)
                live[i] = (s, st, [be.prefill(s, prompts[i], st)])
        for i in [i for i, (_, _, t) in live.items() if len(t) == plan[i][1]]:
            s, _, t = live.pop(i)
            done[i] = t
            be.pool.free(s)
        if not live:
            if len(done) == len(plan):
                break
            continue
        order = list(live)
        rng.shuffle(order)  # the caller's order changes from step to step; rows must not
        out = be.decode([live[i][0] for i in order], [live[i][2][-1] for i in order], [live[i][1] for i in order],
                        run_ahead=run_ahead)
        batch_sizes.append(len(order))
        for i, o in zip(order, out, strict=True):
            live[i][2].append(o)
    assert len(done) == len(plan)
    for i, (_, n) in enumerate(plan):
        want, lg = alone[i]
        same_or_near_tie(done[i], want[:n], lg, f"sequence {i}")
    assert be.pool.n_used == 0
    assert len(set(batch_sizes)) >= 4, batch_sizes
    buckets = {k[0] for k in be.step.graphs}
    assert buckets <= {1, 2, 4, 8} and len(buckets) >= 3, be.step.graphs
    if run_ahead:
        # every join (a prefill between calls) and leave discards a step that ran ahead; whether two
        # calls in a row ever match here depends on the random prompt lengths (page crossings), so the
        # serving path is test_run_ahead_serves_the_same_tokens_across_pages's to check
        assert be.info.get("ahead_discarded", 0) >= 3, be.info
    else:
        assert "ahead_steps" not in be.info and "ahead_discarded" not in be.info


def test_run_ahead_serves_the_same_tokens_across_pages(tied_path, kind, rng):
    """One sequence, 60 greedy steps from a 13-token prompt (positions cross pages at 16, 32, 48, 64),
    every call with run_ahead: the same tokens as without (or a first difference at a near-tie); every step but the first three of the bucket
    (eager, capture, first replay) is served by a step that ran ahead, those whose next position opens a
    page included (the backend gives the page before running ahead). last_logits() refuses while a step is ahead, and works again once a call runs without."""
    be = make_backend(tied_path, kind, max_context=96, n_pages=32)
    V = be.config.vocab
    prompt = rng.integers(0, V, size=13)
    want, want_logits = run_alone(be, [prompt], 61)[0]
    s, st = be.pool.new_sequence(), SamplerState(GREEDY, V)
    toks = [be.prefill(s, prompt, st)]
    for _ in range(60):
        toks.append(be.decode([s], [toks[-1]], [st], run_ahead=True)[0])
    same_or_near_tie(toks, want, want_logits, "run ahead", be=be)
    assert be.info["ahead_steps"] >= 60 - 3 - 1, be.info
    assert be.info.get("ahead_discarded", 0) == 0, be.info
    with pytest.raises(InvalidRequestError, match="ran ahead"):
        be.last_logits()
    toks.append(be.decode([s], [toks[-1]], [st])[0])  # served by the step ahead, none launched after it
    if toks[:61] == want:  # (past a near-tie above the two runs continue from different tokens)
        again, again_logits = run_alone(be, [prompt], 62)[0]
        same_or_near_tie(toks, again, again_logits, "run ahead, then a call without", be=be)
    assert be.last_logits().shape == (1, V)
    be.pool.free(s)
    assert be.pool.n_used == 0


def test_run_ahead_keeps_two_steps_in_flight(tied_path, kind, rng, monkeypatch):
    """With run_ahead, a call whose step was launched ahead queues the step after it before it waits for
    its own ids: every wait but the first finds two steps in flight (the device never idles for the
    host's wake-up and launch), page crossings included; ids come back in launch order, so the tokens
    are those without run_ahead (or differ first at a near-tie). A call without the hint leaves nothing in flight."""
    be = make_backend(tied_path, kind, max_context=96, n_pages=32)
    V = be.config.vocab
    prompt = rng.integers(0, V, size=11)
    want, want_logits = run_alone(be, [prompt], 41)[0]
    seen = []
    collect = be.step.collect
    monkeypatch.setattr(be.step, "collect", lambda bucket: (seen.append(be.step.in_flight), collect(bucket))[1])
    s, st = be.pool.new_sequence(), SamplerState(GREEDY, V)
    toks = [be.prefill(s, prompt, st)]
    for _ in range(40):
        toks.append(be.decode([s], [toks[-1]], [st], run_ahead=True)[0])
        assert be.step.in_flight == len(be._ahead) <= 2
    # the same tokens, or the first difference at a near-tie of the run without (int8 activations turn the
    # host BLAS's last-bit differences between two runs into int8 rounding steps: docs/VALIDATION.md)
    same_or_near_tie(toks, want, want_logits, "run ahead, two in flight", be=be)
    # the bucket's graph exists (run_alone captured it): the first call runs its step and launches one
    # ahead; every later call finds its step in flight and queues the next before waiting
    assert seen[0] == 1 and set(seen[1:]) == {2}, seen
    assert be.info.get("ahead_discarded", 0) == 0 and be.info["ahead_steps"] == 40 - 1, be.info
    assert pages_for(s.length) <= s.n_pages <= pages_for(s.length + 1)
    toks.append(be.decode([s], [toks[-1]], [st])[0])  # served by the step ahead, none launched after it
    assert be.step.in_flight == 0 and toks == run_alone(be, [prompt], 42)[0][0]
    be.pool.free(s)


def test_run_ahead_depth_one_on_request(tied_path, kind, rng, monkeypatch):
    """$NANOQWEN_RUN_AHEAD_DEPTH=1 (the A/B knob): the step after is launched only once the ids are read,
    so every wait finds one step in flight; a value other than 1 or 2 is refused at load."""
    monkeypatch.setenv("NANOQWEN_RUN_AHEAD_DEPTH", "1")
    be = make_backend(tied_path, kind, max_context=96, n_pages=32)
    V = be.config.vocab
    seen = []
    collect = be.step.collect
    monkeypatch.setattr(be.step, "collect", lambda bucket: (seen.append(be.step.in_flight), collect(bucket))[1])
    s, st = be.pool.new_sequence(), SamplerState(GREEDY, V)
    toks = [be.prefill(s, rng.integers(0, V, size=7), st)]
    for _ in range(12):
        toks.append(be.decode([s], [toks[-1]], [st], run_ahead=True)[0])
    assert set(seen) == {1} and be.info["ahead_steps"] >= 12 - 3, (seen, be.info)
    monkeypatch.setenv("NANOQWEN_RUN_AHEAD_DEPTH", "3")
    with pytest.raises(InvalidRequestError, match="NANOQWEN_RUN_AHEAD_DEPTH"):
        make_backend(tied_path, kind, max_context=96, n_pages=32)


def test_run_ahead_serves_a_batch_whose_rows_open_pages_at_different_steps(tied_path, kind, rng):
    """Four sequences whose prompts (5, 9, 12, 16 tokens) put their page crossings on different steps, as
    the engine's staggered admissions do: some row opens a page on every fourth step, and still every
    step after the bucket's first three is served by the step that ran ahead, with each row's tokens
    what it gets alone, its pages exactly what its length needs plus at most the one opened early, and
    the pool whole at the end."""
    be = make_backend(tied_path, kind, max_context=96, max_batch=4, n_pages=32, **BATCH_INVARIANT)
    V = be.config.vocab
    prompts = [rng.integers(0, V, size=n) for n in (5, 9, 12, 16)]
    n_steps = 40
    alone = run_alone(be, prompts, n_steps + 1)
    seqs = [be.pool.new_sequence() for _ in prompts]
    states = [SamplerState(GREEDY, V) for _ in prompts]
    toks = [[be.prefill(s, p, st)] for s, p, st in zip(seqs, prompts, states, strict=True)]
    for _ in range(n_steps):
        out = be.decode(seqs, [t[-1] for t in toks], states, run_ahead=True)
        for t, o in zip(toks, out, strict=True):
            t.append(o)
        for s in seqs:
            assert pages_for(s.length) <= s.n_pages <= pages_for(s.length + 1), (s.length, s.n_pages)
    for b, (want, lg) in enumerate(alone):
        same_or_near_tie(toks[b], want[: n_steps + 1], lg, f"row {b}")
    assert be.info["ahead_steps"] >= n_steps - 4, be.info
    be.decode(seqs, [t[-1] for t in toks], states)  # collects the step ahead; none launched after it
    for s in seqs:
        be.pool.free(s)
    assert be.pool.n_used == 0


def test_mixed_greedy_and_sampled_rows(tied_path, kind, rng):
    """Greedy and sampled requests in one batch (the "sample" graph): the greedy row gets its greedy tokens
    and a seeded sampled row its tokens alone; the same seed twice gives the same tokens.

    A sampled row's draw is a function of (seed, position, logits), and a batch's logits differ from a
    batch of one's in the last bits (the GEMV build and its summation order depend on B), so a sampled
    token may flip where the uniform draw falls within that noise of a boundary of the distribution. A
    flip is accepted only where the row's logits at that step equal its alone-logits to 1e-2 relative:
    the row had its own sequence's state and history (a row mix-up gives logits of order-1 difference)."""
    be = make_backend(tied_path, kind, max_context=64, **BATCH_INVARIANT)
    V = be.config.vocab
    hot = SamplingParams(temperature=0.9, top_k=40, seed=int(rng.integers(2**31))).resolve({})
    pen = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.3, seed=7).resolve({})
    prompts = [rng.integers(0, V, size=n) for n in (12, 20, 7)]
    params = [GREEDY, hot, pen]
    alone = [run_alone(be, [p], 10, prm)[0] for p, prm in zip(prompts, params, strict=True)]
    assert run_alone(be, [prompts[1]], 10, hot)[0][0] == alone[1][0], "seeded sampling is reproducible"
    seqs = [be.pool.new_sequence() for _ in prompts]
    sts = [SamplerState(prm, V) for prm in params]
    toks, lg = [], []
    for s, p, st in zip(seqs, prompts, sts, strict=True):
        toks.append([be.prefill(s, p, st)])
        lg.append([be.last_logits()[0].copy()])
    for _ in range(9):
        for b, o in enumerate(be.decode(seqs, [t[-1] for t in toks], sts)):
            toks[b].append(o)
            lg[b].append(be.last_logits()[b].copy())
    same_or_near_tie(toks[0], alone[0][0], alone[0][1], "row 0 (greedy)")
    for b in (1, 2):
        want, want_lg = alone[b]
        i = next((k for k, (x, y) in enumerate(zip(toks[b], want, strict=True)) if x != y), None)
        last = len(want) if i is None else i + 1
        for k in range(last):  # up to and including the first flip the row saw what it saw alone
            rel = np.linalg.norm(lg[b][k] - want_lg[k]) / np.linalg.norm(want_lg[k])
            assert rel < 1e-2, f"row {b}, token {k}: logits differ from the row's alone-logits by {rel:.3g}"
    assert (3, "sample") in be.step.graphs or (4, "sample") in be.step.graphs


def test_pool_exhaustion_is_clean_and_backend_stays_usable(tied_path, kind, rng):
    be = make_backend(tied_path, kind, max_context=32, n_pages=3)  # 3 pages of 16 tokens
    hog = be.pool.new_sequence()
    be.pool.grow(hog, 32)  # 2 of 3 pages taken
    seq = be.pool.new_sequence()
    with pytest.raises(KVPagesExhaustedError):
        be.prefill(seq, rng.integers(0, 4096, size=20), SamplerState(GREEDY, 4096))
    assert seq.length == 0 and seq.n_pages == 0 and be.pool.n_free == 1
    be.pool.free(hog)
    be.pool.free(seq)
    ids = rng.integers(0, 4096, size=20)
    a, s = generate(be, ids, 8)
    assert len(a) == 8 and s.length == 27


def test_decode_batch_is_all_or_nothing(tied_path, kind, rng):
    """Two sequences each about to cross into a new page, one free page: the step raises before any GPU
    work, nothing grows; freeing a page lets the same step run."""
    be = make_backend(tied_path, kind, max_context=48, n_pages=5)
    V = be.config.vocab
    seqs = [be.pool.new_sequence() for _ in range(2)]
    sts = [SamplerState(GREEDY, V) for _ in seqs]
    toks = [be.prefill(s, rng.integers(0, V, size=16), st) for s, st in zip(seqs, sts, strict=True)]
    hog = be.pool.new_sequence()
    be.pool.grow(hog, 32)  # 2 + 2 pages used, 1 free; each decode row needs a second page
    before = [(s.length, s.n_pages, s.page_table.copy()) for s in seqs]
    with pytest.raises(KVPagesExhaustedError, match="needs 2 more pages"):
        be.decode(seqs, toks, sts)
    assert [(s.length, s.n_pages) for s in seqs] == [(b[0], b[1]) for b in before]
    assert all((s.page_table == b[2]).all() for s, b in zip(seqs, before, strict=True))
    assert be.pool.n_free == 1
    be.pool.free(hog)
    out = be.decode(seqs, toks, sts)
    assert len(out) == 2 and [s.length for s in seqs] == [17, 17]


def test_failed_launch_leaves_backend_usable(tied_path, kind, monkeypatch, rng):
    be = make_backend(tied_path, kind, max_context=64)
    ids = rng.integers(0, 4096, size=18)
    want, s = generate(be, ids, 6)
    be.pool.free(s)

    def boom(*a, **k):
        raise RuntimeError("injected launch failure")

    seq = be.pool.new_sequence()
    st = SamplerState(GREEDY, 4096)
    tok = be.prefill(seq, ids, st)
    monkeypatch.setattr(be.step, "run", boom)
    with pytest.raises(RuntimeError, match="injected"):
        be.decode([seq], [tok], [st])
    monkeypatch.undo()
    be.pool.free(seq)
    assert be.step.shadow is None  # stale device state is sent again next time
    assert generate(be, ids, 6)[0] == want


def test_bad_requests_raise_clear_errors(tied_path, kind):
    be = make_backend(tied_path, kind, max_context=64, max_batch=2)
    seq = be.pool.new_sequence()
    st = SamplerState(GREEDY, 4096)
    with pytest.raises(InvalidRequestError, match="out of range"):
        be.prefill(seq, np.array([5, 4096]), st)
    with pytest.raises(InvalidRequestError, match="at least one"):
        be.prefill(seq, np.array([], dtype=np.int32), st)
    tok = be.prefill(seq, np.array([5, 6, 7]), st)
    with pytest.raises(InvalidRequestError, match="one token id and one sampler"):
        be.decode([seq], [tok, tok], [st])
    with pytest.raises(InvalidRequestError, match="twice"):
        be.decode([seq, seq], [tok, tok], [st, st])
    with pytest.raises(InvalidRequestError, match="max_batch"):
        be.decode([seq] * 3, [tok] * 3, [st] * 3)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        be.decode([seq], [4096], [st])
    other = be.pool.new_sequence()
    be.pool.free(other)
    with pytest.raises(InvalidRequestError, match="not live"):
        be.decode([other], [tok], [st])
    assert seq.length == 3 and be.decode([], [], []) == []
    with pytest.raises(InvalidRequestError, match="decode_mode"):
        make_backend(tied_path, kind, decode_mode="fast")
    with pytest.raises(InvalidRequestError, match="max_batch"):
        make_backend(tied_path, kind, max_batch=0)


def test_out_of_memory_during_a_request_is_clean(tied_path, kind, monkeypatch, rng):
    """OOM inside a request: GPUOutOfMemoryError, the pool and the backend usable afterwards. On the GPU
    CuPy's own allocation path raises its OutOfMemoryError (an allocator with nothing left); on the host an
    injected MemoryError. (Filling the GPU with a hog first was flaky: CuPy's pool keeps split blocks it
    cannot release, and the prefill's temporaries were sometimes served from them.)"""
    from nanoqwen_engine.cuda import GPUOutOfMemoryError

    be = make_backend(tied_path, kind, max_context=512)
    ids = rng.integers(0, 4096, size=300)
    want, s = generate(be, ids, 4)
    be.pool.free(s)
    if kind == "gpu":
        import cupy

        pool = cupy.get_default_memory_pool()

        def exhausted(size):
            raise cupy.cuda.memory.OutOfMemoryError(size, pool.total_bytes(), 0)

        pool.free_all_blocks()  # nothing cached: every temporary must come from the allocator
        cupy.cuda.set_allocator(exhausted)
    else:
        def oom(*a, **k):
            raise MemoryError("injected")

        monkeypatch.setattr(be.prefill_pass, "hidden_many", oom)
    seq = be.pool.new_sequence()
    try:
        with pytest.raises(GPUOutOfMemoryError, match="out of GPU memory"):
            be.prefill(seq, ids, SamplerState(GREEDY, 4096))
    finally:
        if kind == "gpu":
            cupy.cuda.set_allocator(pool.malloc)
    be.pool.free(seq)
    monkeypatch.undo()
    assert be.pool.n_used == 0
    assert generate(be, ids, 4)[0] == want


def test_no_gpu_and_wrong_gpu_are_clear_errors(tied_path, monkeypatch):
    import nanoqwen_kernels
    from nanoqwen_engine.cuda import WrongGPUError
    from nanoqwen_engine.errors import NoGPUError

    nq, cfg = open_file(tied_path)
    monkeypatch.setattr(nanoqwen_kernels, "gpu_status", lambda: (False, "device compute capability 8.0 is not 9.x (Hopper)"))
    with pytest.raises(WrongGPUError, match="sm_90"):
        CudaBackend.create(nq, cfg, progress=False)
    monkeypatch.setattr(nanoqwen_kernels, "gpu_status", lambda: (False, "CuPy not importable: no module"))
    with pytest.raises(NoGPUError, match="no usable GPU: CuPy not importable"):
        CudaBackend.create(nq, cfg, progress=False)


def test_ctrl_is_copied_only_where_it_changed(tied_path, monkeypatch, rng):
    """Host side of the batched step: a steady batch sends nothing to ctrl between steps except the page
    id of a row that crossed into a new page (one small copy); a new sequence in a row sends its table."""
    from nanoqwen_engine.cuda.decode import _spans

    be = make_backend(tied_path, "host", max_context=96, n_pages=32)
    V = be.config.vocab
    copies = []
    real = be.dev.h2d

    def h2d(dst, src):
        if np.shares_memory(dst, be.step.ctrl):
            copies.append(int(np.asarray(src).size))
        real(dst, src)

    monkeypatch.setattr(be.dev, "h2d", h2d)
    seqs = [be.pool.new_sequence() for _ in range(3)]
    sts = [SamplerState(GREEDY, V) for _ in seqs]
    toks = [be.prefill(s, rng.integers(0, V, size=n), st) for s, n, st in zip(seqs, (14, 20, 3), sts, strict=True)]
    for step in range(20):
        copies.clear()
        crossing = [s for s in seqs if s.length % 16 == 0]  # this step's token opens a new page
        toks = be.decode(seqs, toks, sts)
        if step == 0:
            assert len(copies) >= 1  # fresh rows: tokens, positions, tables
        elif crossing:
            assert len(copies) == 1 and copies[0] <= 2 * be.step.layout.max_pages, copies
        else:
            assert copies == [], f"step {step}: nothing changed, yet {copies} entries were copied"
    assert _spans(np.array([5, 3, 9, 100_000, 100_001])) == [(3, 10), (100_000, 100_002)]
    assert _spans(np.array([], dtype=np.int64)) == []
