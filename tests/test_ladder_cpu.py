"""The ladder's CPU-side logic (nanoqwen_engine.validation): the prompt set, divergence judging, margins,
the report, and compare_greedy end to end on the CPU reference (no GPU needed)."""

from __future__ import annotations

import numpy as np
import pytest
from nanoqwen_engine import Engine
from nanoqwen_engine.tokenizer import Tokenizer
from nanoqwen_engine.validation import (
    PAGE_BOUNDARY_LENGTHS,
    LadderReport,
    PromptResult,
    build_prompts,
    compare_greedy,
    first_divergence,
    format_report,
    greedy_tokens,
    judge,
    logit_error,
    margins_at,
    prompt_lengths,
    reference_tokens_parallel,
    text_of_length,
)
from nanoqwen_format import open_model


@pytest.fixture(scope="module")
def tokenizer(ladder_tiny_path):
    nq = open_model(ladder_tiny_path)
    return Tokenizer(nq.tokenizer_json, nq.tokenizer_config)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return build_prompts(tokenizer, n=100)


def _ids(tokenizer, p):
    text = p.text if p.text is not None else tokenizer.apply_chat_template(list(p.messages))
    return tokenizer.encode(text)


def test_prompt_set_is_diverse_and_lengths_are_exact(prompts, tokenizer):
    assert len(prompts) == 100
    assert len({p.name for p in prompts}) == 100
    assert len({str(p.payload) for p in prompts}) == 100  # no two prompts alike
    kinds = {p.kind for p in prompts}
    assert {"raw", "boundary", "code", "prose", "chat"} <= kinds
    lengths = [len(_ids(tokenizer, p)) for p in prompts]
    for p, n in zip(prompts, lengths, strict=True):
        if p.n_tokens is not None:
            assert n == p.n_tokens, p.name
    assert min(lengths) == 1 and max(lengths) == 2000
    assert set(PAGE_BOUNDARY_LENGTHS) <= set(lengths)
    names = " ".join(p.name for p in prompts)
    for lang in ("python", "c", "rust", "javascript", "go", "sql", "bash", "cuda"):
        assert f"-{lang}-" in names


def test_prompt_lengths_and_exact_cut(tokenizer):
    ls = prompt_lengths(40, max_tokens=500, seed=3)
    assert len(ls) == 40 and min(ls) >= 1 and max(ls) == 500
    assert ls == prompt_lengths(40, max_tokens=500, seed=3)  # deterministic for a seed
    for n in (1, 7, 16, 129):
        assert len(tokenizer.encode(text_of_length(tokenizer, "héllo wörld, def f(x): return x*2 ", n))) == n
    with pytest.raises(ValueError):
        text_of_length(tokenizer, "abc", 0)


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2], [1, 2, 3]) is None  # one stopped early (eos): not a divergence
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([], [4]) is None


def test_margins_and_judging(rng):
    logits = rng.normal(size=50).astype(np.float32)
    order = np.argsort(logits)[::-1]
    top, second, far = int(order[0]), int(order[1]), int(order[10])
    top2, gap = margins_at(logits, top, second)
    assert top2 == pytest.approx(float(logits[top] - logits[second]))
    assert gap == pytest.approx(top2)  # other engine picked the runner-up: gap is the top-2 margin
    _, gap_far = margins_at(logits, top, far)
    assert gap_far > top2
    calls = []

    def at(i):
        calls.append(i)
        return logits

    # the engine under test picked the runner-up at position 2
    a, b = [7, 8, second, 1], [7, 8, top, 2]
    matched, div, m, g, ok = judge(a, b, at, eps=top2 + 1e-3)
    assert (matched, div, ok) == (2, 2, True) and calls == [2]
    assert judge(a, b, at, eps=top2 / 2)[-1] is False  # same divergence, margin above eps: a bug
    a_far = [7, 8, far, 1]
    assert judge(a_far, b, at, eps=top2 + 1e-3)[-1] is False  # not the runner-up: a bug
    assert judge([1, 2], [1, 2], at, eps=0.0) == (2, None, None, None, True)


class _FakeEngine:
    """encode_prompt / complete / score: a deterministic toy model over a 32-token vocab."""

    def __init__(self, table: np.ndarray, flip_at: dict | None = None):
        self.table, self.flip_at = table, flip_at or {}

    def encode_prompt(self, payload):
        return [ord(c) % 32 for c in (payload if isinstance(payload, str) else payload[-1]["content"])]

    def _logits(self, ids):
        return self.table[ids[-1]] + 0.01 * len(ids)

    def score(self, ids):
        ids = list(ids)
        return np.stack([self._logits(ids[: i + 1]) for i in range(len(ids))])

    def complete(self, payload, params):
        ids, out = self.encode_prompt(payload), []
        for i in range(params.max_tokens):
            t = int(np.argmax(self._logits(ids)))
            if i in self.flip_at.get(payload if isinstance(payload, str) else "", ()):
                t = int(np.argsort(self._logits(ids))[-2])  # the runner-up: what a rounding flip picks
            ids.append(t)
            out.append(t)

        class C:
            token_ids = out

        return C()


def test_compare_greedy_counts_and_judges():
    table = np.random.default_rng(5).normal(size=(32, 32)).astype(np.float32)
    ref = _FakeEngine(table)
    same = _FakeEngine(table)
    rep = compare_greedy(same, ref, ["abc", "hello", [{"role": "user", "content": "hi"}]], max_tokens=6)
    assert rep.ok and rep.n_exact == 3 and rep.match_fraction == 1.0
    flipped = _FakeEngine(table, flip_at={"hello": (3,)})
    rep = compare_greedy(flipped, ref, ["abc", "hello"], max_tokens=6, eps=100.0)
    r = rep.results[1]
    assert (r.divergence, r.matched) == (3, 3) and r.ok and rep.n_near_tie == 1
    assert r.ref_gap == pytest.approx(r.ref_top2_margin)
    strict = compare_greedy(flipped, ref, ["hello"], max_tokens=6, eps=0.0)
    assert not strict.ok and strict.n_bad == 1
    text = format_report(strict)
    assert "BUG" in text and "1 bad" in text
    d = strict.as_dict()
    assert d["n_bad"] == 1 and d["results"][0]["divergence"] == 3


def test_compare_greedy_on_the_cpu_reference_against_itself(ladder_tiny_path):
    a = Engine.load(ladder_tiny_path, device="cpu", max_context=256, progress=False)
    b = Engine.load(ladder_tiny_path, device="cpu", max_context=256, progress=False)
    ps = build_prompts(a.tokenizer, n=3, max_tokens=40)
    rep = compare_greedy(a, b, ps, max_tokens=4)
    assert rep.ok and rep.n_exact == 3, format_report(rep)
    assert all(len(r.tokens_a) >= 1 for r in rep.results)


def test_reference_tokens_parallel_equals_sequential(ladder_tiny_path):
    e = Engine.load(ladder_tiny_path, device="cpu", max_context=128, progress=False)
    ps = build_prompts(e.tokenizer, n=3, max_tokens=30)
    par = reference_tokens_parallel(ladder_tiny_path, ps, 4, 128, workers=2)
    assert par == [greedy_tokens(e, p.payload, 4) for p in ps]


def test_logit_error(rng):
    b = rng.normal(size=(3, 10))
    e = logit_error(b + 1e-3, b)
    assert e["max_abs"] == pytest.approx(1e-3) and e["argmax_agree"] == 1.0 and e["finite"]
    assert logit_error(np.full_like(b, np.nan), b)["finite"] is False


def test_report_of_empty_and_mixed():
    rep = LadderReport(eps=0.1, max_tokens=4)
    assert rep.ok and rep.match_fraction == 0.0
    rep.results.append(PromptResult("p", "raw", 3, [1, 2], [1, 3], 1, 1, 0.05, 0.05, True))
    assert "near-tie" in format_report(rep) and rep.n_near_tie == 1


def test_eps_follows_the_engines_decode_activations(ladder_tiny_path, monkeypatch):
    """The near-tie bound is the decode activations' own: the CPU reference (and fp16 GPU decode) at
    DEFAULT_EPS, int8 at INT8_EPS (wider: its rounding moves a random model's gap ~10x more); on the GPU
    path's host stand-ins, which report what they multiply as the GPU backend does."""
    from ladder.engines import gpu_engine
    from nanoqwen_engine.validation import DEFAULT_EPS, EPS, INT8_EPS, eps_for

    assert EPS == {"fp16": DEFAULT_EPS, "int8": INT8_EPS} and DEFAULT_EPS < INT8_EPS < 1.0
    cpu = Engine.load(str(ladder_tiny_path), device="cpu", max_context=64, progress=False)
    assert eps_for(cpu) == DEFAULT_EPS
    monkeypatch.setenv("NANOQWEN_LADDER_HOST", "1")
    assert eps_for(gpu_engine(ladder_tiny_path, max_context=64)) == INT8_EPS  # the default
    assert eps_for(gpu_engine(ladder_tiny_path, max_context=64, decode_activations="fp16")) == DEFAULT_EPS
