"""GPU: the device sampler's rows against the engine's numpy sampler (sampler.py), the semantics both
implement (transformers' order: repetition penalty, temperature, top-k, top-p, min-p).

One batch holds rows of every kind at once (greedy, greedy with a penalty, top-k, top-p, min-p, all of
them with a penalty), each loaded from its own SamplerState through DeviceSampler.load, as the backend
does. Greedy rows must give numpy's argmax of the processed logits exactly; sampled rows must draw only
ids numpy keeps (finite processed logits) with frequencies matching numpy's probabilities (chi-square
bound over many draws; the seen-ids masks are restored before each draw, so every draw sees the same
distribution).
"""

from __future__ import annotations

import numpy as np
import pytest
from nanoqwen_engine.params import SamplingParams
from nanoqwen_engine.sampler import SamplerState, _softmax, processed_logits

pytestmark = pytest.mark.gpu

V = 512  # below the kernel's 1024-candidate cap, so the kernel's support is numpy's exactly
CASES = [
    dict(temperature=0.0),
    dict(temperature=0.0, repetition_penalty=1.3),
    dict(temperature=0.8, top_k=20),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=0.7, min_p=0.1),
    dict(temperature=1.2, top_k=50, top_p=0.95, repetition_penalty=1.5),
]


@pytest.fixture(scope="module")
def parts():
    from nanoqwen_kernels import gpu_status

    ok, reason = gpu_status()
    if not ok:
        pytest.skip(f"no usable GPU: {reason}")
    from nanoqwen_engine.cuda.device import CupyDevice
    from nanoqwen_kernels import loader
    from nanoqwen_kernels.dims import TINY
    from nanoqwen_kernels.sampling import SamplingKernels

    # the sampler's source is the same for every model; V is a run-time length
    return CupyDevice(), SamplingKernels(TINY, lambda s, d: loader.load_module(s, d))


def test_rows_follow_the_numpy_sampler(parts, rng):
    from nanoqwen_engine.cuda.sampling import SAMPLE, DeviceSampler

    dev, ks = parts
    cp = dev.xp
    B = len(CASES)
    ds = DeviceSampler(dev, ks, V, max_batch=B)
    samplers, start = [], rng.integers(1000, size=B)
    for b, c in enumerate(CASES):
        st = SamplerState(SamplingParams(seed=int(rng.integers(2**31)), **c).resolve({}), V)
        st.observe(rng.integers(0, V, size=40))  # a prompt: the repetition-penalty set
        samplers.append(st)
        ds.load(b, st, step=int(start[b]))
    x = (2.5 * rng.standard_normal((B, V))).astype(np.float32)
    logits = cp.asarray(x)
    tokens = cp.zeros(B, dtype=np.int32)
    saved = ds.history[:B].copy()
    want = [processed_logits(x[b], s.params, s.seen) for b, s in enumerate(samplers)]
    draws = 3000
    got = np.empty((draws, B), dtype=np.int64)
    with dev.use():
        for t in range(draws):
            ds.history[:B] = saved  # every draw from the same distribution
            ds.launch(ks, SAMPLE, logits, tokens, 0, B)
            got[t] = tokens.get(stream=dev.stream)
    steps = ds.rng[:B, 1].get()
    for b, c in enumerate(CASES):
        if c["temperature"] == 0:
            assert (got[:, b] == int(np.argmax(want[b]))).all(), f"row {b} {c}"
            continue
        assert np.isfinite(want[b][got[:, b]]).all(), f"row {b} {c}: drew an id numpy removes"
        p = _softmax(want[b])
        counts = np.bincount(got[:, b], minlength=V)
        exp = p * draws
        m = exp > 0
        chi2 = (((counts - exp) ** 2)[m] / exp[m]).sum()
        df = max(int(m.sum()) - 1, 1)
        assert chi2 < df + 6 * np.sqrt(2 * df) + 10, f"row {b} {c}: chi2 {chi2:.1f} for {df} dof"
    assert (steps == start + draws).all(), "each row's counter advances once per draw"


def test_load_sets_the_row_and_history_only_when_penalised(parts, rng):
    from nanoqwen_engine.cuda.sampling import DeviceSampler

    dev, ks = parts
    ds = DeviceSampler(dev, ks, V, max_batch=2)
    plain = SamplerState(SamplingParams(temperature=0.5, seed=11).resolve({}), V)
    pen = SamplerState(SamplingParams(temperature=0.5, repetition_penalty=1.2, seed=12).resolve({}), V)
    for st in (plain, pen):
        st.observe(rng.integers(0, V, size=30))
    with dev.use():
        ds.load(0, plain, step=5)
        ds.load(1, pen, step=9)
        ds.mark(1, 3)
        rng_rows, hist = ds.rng.get(stream=dev.stream), ds.history.get(stream=dev.stream)
    assert rng_rows[:2].tolist() == [[11, 5], [12, 9]]
    assert not hist[0].any(), "a request without penalty needs no history upload"
    want = pen.seen.copy()
    want[3] = True
    np.testing.assert_array_equal(hist[1].astype(bool), want)
