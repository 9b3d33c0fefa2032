"""Sampler: masks exact on hand-made distributions, greedy, seeds, temperature and repetition penalty."""

from __future__ import annotations

import numpy as np
import pytest
from nanoqwen_engine import InvalidRequestError, SamplingParams
from nanoqwen_engine.sampler import (
    SamplerState,
    apply_repetition_penalty,
    min_p_mask,
    processed_logits,
    top_k_mask,
    top_p_mask,
)

PROBS = np.array([0.15, 0.5, 0.05, 0.3])  # a hand-made distribution, deliberately unsorted
LOGITS = np.log(PROBS).astype(np.float32)


def kept(x: np.ndarray) -> list[int]:
    return np.flatnonzero(np.isfinite(x)).tolist()


def params(**kw) -> SamplingParams:
    base = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
    return SamplingParams(**{**base, **kw}).resolve({})


def test_top_k_keeps_the_k_largest_and_ties():
    assert kept(top_k_mask(LOGITS, 1)) == [1]
    assert kept(top_k_mask(LOGITS, 2)) == [1, 3]
    assert kept(top_k_mask(LOGITS, 0)) == [0, 1, 2, 3]
    tied = np.array([1.0, 5.0, 3.0, 5.0, 2.0], dtype=np.float32)
    assert kept(top_k_mask(tied, 1)) == [1, 3]  # transformers keeps everything equal to the k-th
    assert kept(top_k_mask(tied, 3)) == [1, 2, 3]
    out = top_k_mask(LOGITS, 2)
    assert (out[[1, 3]] == LOGITS[[1, 3]]).all()  # kept logits untouched


def test_top_p_removes_the_tail_as_transformers_does():
    # ascending: 0.05, 0.15, 0.3, 0.5 ; cumulative: 0.05, 0.2, 0.5, 1.0 ; removed where cum <= 1 - top_p
    assert kept(top_p_mask(LOGITS, 0.9)) == [0, 1, 3]  # 1-p = 0.1: only 0.05 goes
    assert kept(top_p_mask(LOGITS, 0.75)) == [1, 3]  # 1-p = 0.25: 0.05 and 0.15 go
    assert kept(top_p_mask(LOGITS, 0.55)) == [1, 3]  # 1-p = 0.45: cum 0.5 > 0.45 keeps 0.3
    assert kept(top_p_mask(LOGITS, 0.3)) == [1]  # 1-p = 0.7: cum 0.5 <= 0.7 removes 0.3
    assert kept(top_p_mask(LOGITS, 1e-6)) == [1]  # the top token always stays
    assert kept(top_p_mask(LOGITS, 1.0)) == [0, 1, 2, 3]


def test_min_p_scales_with_the_top_probability():
    assert kept(min_p_mask(LOGITS, 0.2)) == [0, 1, 3]  # threshold 0.1
    assert kept(min_p_mask(LOGITS, 0.5)) == [1, 3]  # threshold 0.25
    assert kept(min_p_mask(LOGITS, 0.61)) == [1]  # threshold 0.305
    assert kept(min_p_mask(LOGITS, 1.0)) == [1]


def test_repetition_penalty_divides_positive_and_multiplies_negative(rng):
    x = rng.normal(size=64).astype(np.float32) * 3
    seen = rng.random(64) < 0.3
    out = apply_repetition_penalty(x, seen, 1.3)
    for i in range(64):
        if not seen[i]:
            assert out[i] == x[i]
        elif x[i] > 0:
            assert out[i] == np.float32(x[i] / np.float32(1.3))
        else:
            assert out[i] == np.float32(x[i] * np.float32(1.3))
        assert out[i] <= x[i]
    assert (apply_repetition_penalty(x, seen, 1.0) == x).all()


def test_penalty_comes_before_temperature():
    x = np.array([2.0, -1.0, 0.5], dtype=np.float32)
    st = SamplerState(params(temperature=0.5, repetition_penalty=2.0), 3)
    st.observe([0, 1])
    expect = np.array([2.0 / 2.0, -1.0 * 2.0, 0.5], dtype=np.float32) / np.float32(0.5)
    np.testing.assert_array_equal(processed_logits(x, st.params, st.seen), expect)


def test_greedy_is_argmax_and_ignores_the_rng(rng):
    for _ in range(20):
        x = rng.normal(size=1000).astype(np.float32)
        assert SamplerState(params(temperature=0), 1000).sample(x) == int(np.argmax(x))


def test_greedy_with_explicit_penalty_avoids_a_seen_token():
    x = np.array([3.0, 2.9, 0.0], dtype=np.float32)
    st = SamplerState(params(temperature=0, repetition_penalty=1.2), 3)
    st.observe([0])
    assert st.sample(x) == 1  # 3.0 / 1.2 = 2.5 < 2.9


def test_seeded_sampling_is_reproducible(rng):
    x = rng.normal(size=500).astype(np.float32)
    def draws(seed):
        st = SamplerState(params(seed=seed, repetition_penalty=1.0), 500)
        return [st.sample(x) for _ in range(60)]
    assert draws(1234) == draws(1234)
    assert draws(1234) != draws(99)


def test_temperature_distribution_matches_softmax(rng):
    x = np.array([1.0, 0.0, -0.5, 2.0], dtype=np.float32)
    for t in (0.5, 1.7):
        st = SamplerState(params(temperature=t, seed=int(rng.integers(1 << 30))), 4)
        st.seen[:] = False
        n = 20000
        counts = np.zeros(4)
        for _ in range(n):
            counts[st.sample(x)] += 1
            st.seen[:] = False
        p = np.exp(x / t) / np.exp(x / t).sum()
        # 5 standard deviations of a binomial count
        assert (np.abs(counts - n * p) < 5 * np.sqrt(n * p * (1 - p)) + 1).all(), (counts / n, p)


def test_masked_tokens_are_never_drawn():
    x = LOGITS.copy()
    st = SamplerState(params(top_k=2, seed=5), 4)
    assert {st.sample(x) for _ in range(300)} == {1, 3}


def test_params_resolve_from_generation_config():
    gc = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    p = SamplingParams().resolve(gc)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.min_p) == (0.7, 0.8, 20, 1.05, 0.0)
    g = SamplingParams(temperature=0, max_tokens=3).resolve(gc)
    assert (g.top_k, g.top_p, g.repetition_penalty, g.max_tokens) == (0, 1.0, 1.0, 3)
    assert SamplingParams(temperature=0, repetition_penalty=1.3).resolve(gc).repetition_penalty == 1.3
    assert SamplingParams(stop="x").stop == ("x",)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("kw", [
    {"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"min_p": 2}, {"max_tokens": 0},
    {"repetition_penalty": 0}, {"stop": [""]},
    # the fuzz's findings: each escaped as IndexError/TypeError later, or degenerated the output
    {"temperature": NAN}, {"temperature": INF}, {"repetition_penalty": NAN}, {"top_p": NAN}, {"min_p": NAN},
    {"max_tokens": "3"}, {"max_tokens": 3.0}, {"max_tokens": True}, {"top_k": 1.5}, {"temperature": "0.7"},
    {"seed": -2}, {"seed": 2**64}, {"seed": 1.5}, {"seed": "7"}, {"stop": 5}, {"stop": [1]},
    {"ignore_eos": 1}, {"temperature": None, "top_p": 1.5},
])
def test_bad_params_are_one_clear_error_naming_the_field(kw):
    field = [k for k, v in kw.items() if v is not None][0]
    with pytest.raises(InvalidRequestError, match=f"SamplingParams.{field}"):
        SamplingParams(**kw)


def test_seed_minus_one_means_random_and_numpy_ints_are_ints():
    a, b = SamplerState(params(seed=-1), 8), SamplerState(params(seed=-1), 8)
    assert SamplingParams(seed=-1).seed is None and a.seed != b.seed  # fresh seeds, reported in stats
    p = SamplingParams(max_tokens=np.int64(5), top_k=np.int32(3), temperature=np.float32(0.5), seed=np.uint64(9))
    assert (p.max_tokens, p.top_k, p.seed) == (5, 3, 9) and type(p.max_tokens) is int
    assert type(p.temperature) is float


@pytest.mark.parametrize("gc, key", [
    ({"temperature": NAN}, "generation_config.temperature"), ({"top_p": "0.8"}, "generation_config.top_p"),
    ({"top_k": 2.5}, "generation_config.top_k"), ({"repetition_penalty": -1}, "generation_config.repetition_penalty"),
    ({"max_new_tokens": 0}, "generation_config.max_new_tokens"), ({"do_sample": "yes"}, "generation_config.do_sample"),
])
def test_bad_generation_config_values_are_config_errors(gc, key):
    from nanoqwen_engine.errors import ConfigError, ModelFormatError
    from nanoqwen_engine.params import check_generation_config

    with pytest.raises(ConfigError, match=key) as e:
        check_generation_config({"do_sample": False, **gc})  # checked even where no request reads it
    assert isinstance(e.value, ModelFormatError)
    with pytest.raises(ConfigError, match=key):  # and where a request reads it
        SamplingParams().resolve({"do_sample": True, "temperature": 0.5, **gc})
