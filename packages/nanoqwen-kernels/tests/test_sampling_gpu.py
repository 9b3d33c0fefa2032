"""GPU: on-device argmax and sampling. argmax exact (ties -> lowest id, replayable in a CUDA graph);
the sampler's masks respected (top-k, top-p, min-p, repetition penalty), seeded draws reproducible,
and the empirical distribution of many draws close to the expected one (chi-square bound)."""

import numpy as np
import pytest
from nanoqwen_kernels import loader
from nanoqwen_kernels.dims import QWEN25_7B, TINY
from nanoqwen_kernels.sampling import SamplingKernels

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["tiny", "7b"])
def kern(request, gpu):
    d = TINY if request.param == "tiny" else QWEN25_7B
    return d, SamplingKernels(d, lambda s, defs: loader.load_module(s, defs))


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_argmax_exact_and_ties(kern):
    import cupy as cp

    d, s = kern
    rng = np.random.default_rng()
    tok = cp.full(1, -1, dtype=np.int32)
    for n in [1, 5, 1000, d.vocab]:
        x = rng.standard_normal(n).astype(np.float32)
        s.argmax(cp.asarray(x), tok)
        assert int(tok.get()[0]) == int(np.argmax(x))
    x = rng.standard_normal(d.vocab).astype(np.float32)
    i, j = sorted(rng.choice(d.vocab, 2, replace=False))
    x[i] = x[j] = x.max() + 1
    s.argmax(cp.asarray(x), tok)
    assert int(tok.get()[0]) == i, "a tie goes to the lowest id"


def test_argmax_and_advance_replay_in_a_graph(kern):
    import cupy as cp

    d, s = kern
    rng = np.random.default_rng()
    logits = cp.asarray(rng.standard_normal(d.vocab).astype(np.float32))
    tok = cp.full(1, -1, dtype=np.int32)
    pos, seq_len = cp.zeros(1, dtype=np.int32), cp.ones(1, dtype=np.int32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        s.argmax(logits, tok)
        s.advance(pos, seq_len)
        graph = stream.end_capture()
    for _ in range(3):
        x = rng.standard_normal(d.vocab).astype(np.float32)
        with stream:  # the upload ordered before the replay on the same stream
            logits.set(x)
        graph.launch(stream)
        stream.synchronize()
        assert int(tok.get()[0]) == int(np.argmax(x))
    assert int(pos.get()[0]) == 3 and int(seq_len.get()[0]) == 4


def _draws(cp, s, logits_np, n_draws, seed=1, history=None, **p):
    params, rng = s.make_sampler_state()
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
    base.update(p)
    s.set_sampler_params(params, rng, seed=seed, **base)
    n = logits_np.size
    logits = cp.asarray(logits_np.astype(np.float32))
    hist = cp.asarray(history if history is not None else np.zeros(n, np.uint8))
    tok = cp.full(1, -1, dtype=np.int32)
    out = cp.full(n_draws, -1, dtype=np.int32)
    for t in range(n_draws):
        if history is not None:
            hist[...] = cp.asarray(history)  # keep the presence mask fixed across draws
        s.sample(logits, params, rng, hist, tok)
        out[t] = tok[0]
    assert int(rng.get()[1]) == n_draws, "the RNG step advances once per draw"
    return out.get(), hist.get()


def test_masks_respected(kern):
    import cupy as cp

    d, s = kern
    rng = np.random.default_rng()
    n = d.vocab
    x = (3 * rng.standard_normal(n)).astype(np.float32)
    order = np.argsort(-x)
    got, hist = _draws(cp, s, x, 200, top_k=5)
    assert set(got) <= set(order[:5])
    assert hist[got].all(), "drawn ids are marked in the presence mask"
    p = _softmax(x.astype(np.float64) / 0.8)
    cum = np.cumsum(p[order])
    nucleus = set(order[: int(np.searchsorted(cum, 0.5)) + 1])
    got, _ = _draws(cp, s, x, 200, temperature=0.8, top_p=0.5)
    assert set(got) <= nucleus
    got, _ = _draws(cp, s, x, 200, min_p=0.2)
    pm = _softmax(x.astype(np.float64))
    assert (pm[got] >= 0.2 * pm.max() * (1 - 1e-5)).all()


def test_repetition_penalty_and_greedy(kern):
    import cupy as cp

    d, s = kern
    rng = np.random.default_rng()
    x = rng.standard_normal(d.vocab).astype(np.float32)
    top = np.argsort(-x)[:3]
    seen = np.zeros(d.vocab, np.uint8)
    seen[top] = 1
    got, _ = _draws(cp, s, x, 5, history=seen, temperature=0.0, repetition_penalty=1.3)
    pen = np.where(seen > 0, np.where(x > 0, x / np.float32(1.3), x * np.float32(1.3)), x)
    assert (got == int(np.argmax(pen))).all()
    got, _ = _draws(cp, s, x, 100, history=seen, repetition_penalty=1e4, top_k=10)
    assert not set(got) & set(top), "heavily penalised seen ids are not drawn"


def test_seeded_reproducible(kern):
    import cupy as cp

    d, s = kern
    x = (2 * np.random.default_rng().standard_normal(d.vocab)).astype(np.float32)
    a, _ = _draws(cp, s, x, 50, seed=1234, temperature=0.9, top_p=0.95)
    b, _ = _draws(cp, s, x, 50, seed=1234, temperature=0.9, top_p=0.95)
    c, _ = _draws(cp, s, x, 50, seed=4321, temperature=0.9, top_p=0.95)
    assert (a == b).all()
    assert (a != c).any()


@pytest.mark.parametrize("cfg", [dict(temperature=0.7), dict(temperature=1.0, top_k=8), dict(top_p=0.8)])
def test_distribution(gpu, cfg):
    # once, on the tiny build: the kernel source is the same for every model; n is a run-time length
    import cupy as cp

    s = SamplingKernels(TINY, lambda src, defs: loader.load_module(src, defs))
    rng = np.random.default_rng()
    n, draws = 40, 4000
    x = rng.standard_normal(n).astype(np.float32)
    got, _ = _draws(cp, s, x, draws, seed=int(rng.integers(2**31)), **cfg)
    t = cfg.get("temperature", 1.0)
    z = x.astype(np.float64) / t
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(n, bool)
    if cfg.get("top_k"):
        keep[order[: cfg["top_k"]]] = True
    else:
        keep[:] = True
    p = np.where(keep, np.exp(z - z.max()), 0)
    p /= p.sum()
    if "top_p" in cfg:
        cum = np.cumsum(p[order])
        above = cum - p[order]
        drop = order[above >= cfg["top_p"]]
        p[drop] = 0
        p /= p.sum()
    assert set(got) <= set(np.nonzero(p)[0])
    counts = np.bincount(got, minlength=n)
    exp = p * draws
    m = exp > 0
    chi2 = (((counts - exp) ** 2)[m] / exp[m]).sum()
    df = m.sum() - 1
    assert chi2 < df + 6 * np.sqrt(2 * df) + 10, f"chi2 {chi2:.1f} for {df} dof"
