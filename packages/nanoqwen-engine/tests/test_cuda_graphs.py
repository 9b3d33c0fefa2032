"""CudaBackend's decode graphs, on the CPU with numpy stand-ins for the GPU and kernels, and on the GPU (every
test also runs with kind="gpu"; marked gpu, skipped without one), as test_cuda_plumbing.py does: which graph a
step replays (a bucket's graph captured once and replayed as sequences join, leave and cross page boundaries;
one per context range), graph against eager, steps run ahead of the host, and what the host copies into ctrl
between steps.
"""

from __future__ import annotations

import numpy as np
import pytest
from cuda_testutil import (
    BATCH_INVARIANT,
    GREEDY,
    generate,
    make_backend,
    run_alone,
    same_or_near_tie,
)
from nanoqwen_engine.errors import InvalidRequestError
from nanoqwen_engine.kv_pages import pages_for
from nanoqwen_engine.sampler import SamplerState


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
    "@mid" graph. At these lengths both grids read every page with the first cluster alone, and no consumer
    warp holds two pages (at most 3 pages over the cluster's 8 blocks), so the short build's page pairs never
    form: the logits are the same bits as a backend's that never takes the short grid, on the GPU too."""
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
