"""`nanoqwen-cli verify`: the reference against itself (plumbing), and a planted divergence (the verdicts)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from nanoqwen_cli import session
from nanoqwen_cli.verify_prompts import PROMPTS, prompt_set


def test_reference_against_itself_is_identical(invoke, tiny_model):
    result = invoke(
        ["verify", "--model", tiny_model, "--device", "cpu", "--prompts", 3, "--max-tokens", 4, "--json"]
    )
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout)
    assert r["prompts"] == r["identical"] == 3 and r["failures"] == 0
    for row in r["results"]:
        assert row["matching"] == row["tokens"] and row["first_divergence"] is None
        assert row["logit_rel_err"] == 0.0, "the same numpy code on the same file gives the same logits"


def test_table_output(invoke, tiny_model):
    result = invoke(["verify", "--model", tiny_model, "--device", "cpu", "--prompts", 2, "--max-tokens", 3])
    assert result.exit_code == 0, result.output
    assert "2/2 identical, 0 near-tie divergences, 0 failures" in result.stdout


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
    """The device under test (the first load) flips token 2; the reference (the second) does not."""
    real_load = session.load
    loads = []

    def load(*args, **kwargs):
        loaded = real_load(*args, **kwargs)
        if not loads:
            loaded.engine = _FlipToken(loaded.engine, at=2)
        loads.append(loaded)
        return loaded

    monkeypatch.setattr(session, "load", load)


def _margins(tiny_engine, n_prompts, at=2):
    """The reference's top-2 logit margin at token `at` of each prompt's greedy continuation."""
    from nanoqwen_engine import SamplingParams

    out = []
    for kind, text in prompt_set(n_prompts):
        request = session.messages_for(text, None) if kind == "chat" else text
        c = tiny_engine.complete(request, SamplingParams(temperature=0, max_tokens=at + 1))
        logits = tiny_engine.score(
            np.asarray(tiny_engine.encode_prompt(request) + c.token_ids[:at], np.int32)
        )[-1]
        top = np.sort(logits.astype(np.float64))[-2:]
        out.append(top[1] - top[0])
    return out


def test_divergence_beyond_eps_fails(invoke, tiny_model, tiny_engine, planted_divergence):
    margins = _margins(tiny_engine, 2)
    eps = min(margins) / 2
    result = invoke(
        [
            "verify",
            "--model",
            tiny_model,
            "--device",
            "cpu",
            "--prompts",
            2,
            "--max-tokens",
            4,
            "--json",
            "--eps",
            eps,
        ]
    )
    assert result.exit_code == 1
    r = json.loads(result.stdout)
    assert r["failures"] == 2
    for row, margin in zip(r["results"], margins, strict=True):
        assert row["first_divergence"] == 2 and row["matching"] == 2 and row["verdict"] == "FAIL"
        assert row["ref_top2_margin"] == pytest.approx(margin, rel=1e-5)


def test_divergence_within_eps_is_a_near_tie(invoke, tiny_model, tiny_engine, planted_divergence):
    eps = max(_margins(tiny_engine, 2)) * 2
    result = invoke(
        ["verify", "--model", tiny_model, "--device", "cpu", "--prompts", 2, "--max-tokens", 4, "--eps", eps]
    )
    assert result.exit_code == 0, result.output
    assert "0/2 identical, 2 near-tie divergences, 0 failures" in result.stdout


def test_prompt_set_is_diverse_and_distinct():
    prompts = prompt_set(len(PROMPTS) + 5)
    assert len(set(prompts)) == len(prompts)
    assert {kind for kind, _ in prompts} == {"chat", "raw"}
