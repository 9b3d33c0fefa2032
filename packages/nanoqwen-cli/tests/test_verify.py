"""`nanoqwen-cli verify`: the reference against itself (plumbing), and a planted divergence (the verdicts)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from nanoqwen_cli import session
from nanoqwen_engine import SamplingParams
from nanoqwen_engine.validation import build_prompts

SMALL = ["--device", "cpu", "--max-tokens", 4, "--max-prompt-tokens", 40]


def test_reference_against_itself_is_identical(invoke, tiny_model):
    result = invoke(["verify", "--model", tiny_model, *SMALL, "--prompts", 3, "--score-prompts", 2, "--json"])
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout)
    assert r["ok"] and r["n_prompts"] == r["n_exact"] == 3 and r["n_bad"] == 0
    for row in r["results"]:
        assert row["tokens_a"] == row["tokens_b"] and row["divergence"] is None
    assert len(r["score"]) == 2
    assert r["max_logit_rel_err"] == 0.0, "the same numpy code on the same file gives the same logits"


def test_table_output(invoke, tiny_model):
    result = invoke(["verify", "--model", tiny_model, *SMALL, "--prompts", 2])
    assert result.exit_code == 0, result.output
    assert "2 prompts x 4 tokens: 2 identical" in result.stdout
    assert "score()" in result.stdout and "[2/2]" in result.stderr


class _FlipToken:
    """The real engine, except that greedy token `at` of every completion is replaced by the runner-up."""

    def __init__(self, engine, at: int):
        self._engine, self._at = engine, at

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def complete(self, request, params=None):
        c = self._engine.complete(request, params)
        if len(c.token_ids) > self._at:
            prefix = self._engine.encode_prompt(request) + c.token_ids[: self._at]
            logits = self._engine.score(np.asarray(prefix, dtype=np.int32))[-1]
            c.token_ids = [*c.token_ids[: self._at], int(np.argsort(logits)[-2])]
        return c


@pytest.fixture
def planted_divergence(monkeypatch):
    """verify loads the reference first, then the engine under test: the latter flips token 2."""
    real_load = session.load
    loads = []

    def load(*args, **kwargs):
        loaded = real_load(*args, **kwargs)
        if loads:
            loaded.engine = _FlipToken(loaded.engine, at=2)
        loads.append(loaded)
        return loaded

    monkeypatch.setattr(session, "load", load)


def _margins(engine, n_prompts, at=2):
    """The reference's top-2 logit margin at token `at` of each prompt's greedy continuation."""
    out = []
    for p in build_prompts(engine.tokenizer, n=n_prompts, max_tokens=40):
        c = engine.complete(p.payload, SamplingParams(temperature=0, max_tokens=at + 1))
        logits = engine.score(np.asarray(engine.encode_prompt(p.payload) + c.token_ids[:at], np.int32))[-1]
        top = np.sort(logits.astype(np.float64))[-2:]
        out.append(top[1] - top[0])
    return out


def test_divergence_beyond_eps_fails(invoke, tiny_model, tiny_engine, planted_divergence):
    margins = _margins(tiny_engine, 2)
    eps = min(margins) / 2
    result = invoke(["verify", "--model", tiny_model, *SMALL, "--prompts", 2, "--json", "--eps", eps])
    assert result.exit_code == 1
    r = json.loads(result.stdout)
    assert not r["ok"] and r["n_bad"] == 2
    for row, margin in zip(r["results"], margins, strict=True):
        assert row["divergence"] == 2 and row["matched"] == 2 and not row["ok"]
        assert row["ref_gap"] == pytest.approx(margin, rel=1e-5), "the flipped token is the runner-up"


def test_divergence_within_eps_is_a_near_tie(invoke, tiny_model, tiny_engine, planted_divergence):
    eps = max(_margins(tiny_engine, 2)) * 2
    result = invoke(["verify", "--model", tiny_model, *SMALL, "--prompts", 2, "--eps", eps])
    assert result.exit_code == 0, result.output
    assert "0 identical, 2 near-tie divergences" in result.stdout
