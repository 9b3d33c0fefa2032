"""perplexity(): windows, token weighting and the float64 log-softmax, against a direct computation here."""

from __future__ import annotations

import math

import numpy as np
import pytest
from nanoqwen_engine import InvalidRequestError
from nanoqwen_engine.perplexity import perplexity, planned_tokens, split_windows, token_nll

TEXT = ("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
        "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop()\n\n"
        "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    pivot, rest = xs[0], xs[1:]\n"
        "    return quicksort([x for x in rest if x < pivot]) + [pivot] + quicksort([x for x in rest if x >= pivot])\n")


@pytest.fixture
def rng(request):
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"seed {seed}")  # shown with the failure
    return np.random.default_rng(seed)


def direct_nll(engine, ids, window):
    """Per window: logits of the window scored alone, softmax in float64, -log p(next token)."""
    out = []
    for a in range(0, len(ids), window):
        w = ids[a:a + window]
        if len(w) < 2:
            continue
        z = engine.score(w).astype(np.float64)  # [len, V]
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        out.append(-np.log(p[np.arange(len(w) - 1), w[1:]]))
    return out


@pytest.mark.parametrize("window", [17, 40, 96])
def test_matches_direct_computation(tiny_engine, window):
    ids = tiny_engine.tokenizer.encode(TEXT, parse_special=False)
    assert len(ids) > 96  # several windows at 17 and 40, a tail that counts, and one full window at 96
    want = direct_nll(tiny_engine, ids, window)
    steps = []
    r = perplexity(tiny_engine, ids, window=window, progress=lambda n, ppl: steps.append((n, ppl)))
    flat = np.concatenate(want)
    assert r.windows == len(want) and r.tokens_scored == flat.size == planned_tokens(len(ids), window)
    np.testing.assert_allclose(r.token_nll, flat, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(r.window_nll, [w.mean() for w in want], rtol=1e-9)
    assert r.nll_mean == pytest.approx(flat.mean(), rel=1e-12)  # token-weighted, not a mean of windows
    assert r.ppl == pytest.approx(math.exp(flat.mean()), rel=1e-12)
    assert [n for n, _ in steps] == [w.size for w in want]
    assert steps[-1][1] == pytest.approx(r.ppl, rel=1e-12)
    d = r.as_dict()
    assert d["tokens_scored"] == flat.size and d["windows"] == len(want) and d["window"] == window


def test_window_split_and_limit():
    assert split_windows(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert split_windows(9, 4) == [(0, 4), (4, 8)]  # a 1-token tail predicts nothing
    assert split_windows(12, 4, max_windows=2) == [(0, 4), (4, 8)]
    assert planned_tokens(10, 4) == 3 + 3 + 1


def test_max_windows_scores_a_prefix(tiny_engine):
    ids = tiny_engine.tokenizer.encode(TEXT, parse_special=False)
    full = perplexity(tiny_engine, ids, window=20)
    two = perplexity(tiny_engine, ids, window=20, max_windows=2)
    assert two.windows == 2 and two.tokens_scored == 38
    np.testing.assert_array_equal(two.token_nll, full.token_nll[:38])


def test_token_nll_is_float64_where_float32_is_not_enough(rng):
    # log(1 + e^-30) = 9.4e-14 vanishes in float32 arithmetic; the float64 log-softmax keeps it.
    z = np.array([[0.0, -30.0], [-30.0, 0.0]], np.float32)
    nll = token_nll(z, [0, 0])
    assert nll.dtype == np.float64
    assert nll[0] == pytest.approx(math.log1p(math.exp(-30)), rel=1e-6)
    assert nll[1] == pytest.approx(30 + math.log1p(math.exp(-30)), rel=1e-12)
    big = (rng.standard_normal((300, 1000)) * 50).astype(np.float32)  # crosses ROW_BLOCK, large logits
    t = rng.integers(0, 1000, 300)
    z64 = big.astype(np.float64)
    want = np.log(np.exp(z64 - z64.max(1, keepdims=True)).sum(1)) + z64.max(1) - z64[np.arange(300), t]
    np.testing.assert_allclose(token_nll(big, t), want, rtol=1e-12)


def test_refuses_bad_requests(tiny_engine):
    ids = tiny_engine.tokenizer.encode(TEXT, parse_special=False)
    with pytest.raises(InvalidRequestError, match="at least 2 tokens"):
        perplexity(tiny_engine, ids, window=1)
    with pytest.raises(InvalidRequestError, match="exceeds the context of 96"):
        perplexity(tiny_engine, ids, window=97)
    with pytest.raises(InvalidRequestError, match="needs at least 2"):
        perplexity(tiny_engine, ids[:1], window=16)
    with pytest.raises(InvalidRequestError, match="needs at least 2"):
        perplexity(tiny_engine, [], window=16)
    with pytest.raises(InvalidRequestError, match="max_windows"):
        perplexity(tiny_engine, ids, window=16, max_windows=0)
