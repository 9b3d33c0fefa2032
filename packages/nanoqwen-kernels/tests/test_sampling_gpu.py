"""GPU: on-device argmax and sampling over batches. argmax exact per row (ties -> lowest id, replayable in
a CUDA graph); the sampler's masks respected (top-k, top-p, min-p, repetition penalty), seeded draws
reproducible, a row's draw independent of the batch it runs in, and the empirical distribution of many
draws close to the expected one (chi-square bound). The comparison with the engine's numpy sampler lives
in the engine's tests (test_cuda_sampler.py)."""

import numpy as np
import pytest
from nanoqwen_kernels import loader
from nanoqwen_kernels.dims import QWEN25_7B, TINY
from nanoqwen_kernels.sampling import SamplingKernels, pack_params, pack_rng

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["tiny", "7b"])
def kern(request, gpu):
    d = TINY if request.param == "tiny" else QWEN25_7B
    return d, SamplingKernels(d, lambda s, defs: loader.load_module(s, defs))


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_argmax_exact_and_ties(kern, rng):
    import cupy as cp

    d, s = kern
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


@pytest.mark.parametrize("rows", [2, 7, 64])
def test_argmax_per_row(kern, rows, rng):
    """Every row its own argmax (ties in some rows, the winner anywhere in the row); twice in a row, so
    the per-row tickets are seen re-armed."""
    import cupy as cp

    d, s = kern
    x = rng.standard_normal((rows, d.vocab)).astype(np.float32)
    for b in range(0, rows, 3):  # a tie in every third row
        i, j = sorted(rng.choice(d.vocab, 2, replace=False))
        x[b, i] = x[b, j] = x[b].max() + 1
    tok = cp.full(rows, -1, dtype=np.int32)
    for _ in range(2):
        s.argmax(cp.asarray(x), tok)
        np.testing.assert_array_equal(tok.get(), np.argmax(x, axis=1))


def test_argmax_and_advance_replay_in_a_graph(kern, rng):
    import cupy as cp

    d, s = kern
    rows = 4
    logits = cp.asarray(rng.standard_normal((rows, d.vocab)).astype(np.float32))
    tok = cp.full(rows, -1, dtype=np.int32)
    pos = cp.asarray(np.array([0, 5, 0, 9], np.int32))
    seq_len = cp.asarray(np.array([1, 6, 0, 10], np.int32))  # row 2 idle: stays at (0, 0)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        s.argmax(logits, tok)
        s.advance(pos, seq_len)
        graph = stream.end_capture()
    for _ in range(3):
        x = rng.standard_normal((rows, d.vocab)).astype(np.float32)
        with stream:  # the upload ordered before the replay on the same stream
            logits.set(x)
        graph.launch(stream)
        stream.synchronize()
        np.testing.assert_array_equal(tok.get(), np.argmax(x, axis=1))
    assert pos.get().tolist() == [3, 8, 0, 12] and seq_len.get().tolist() == [4, 9, 0, 13]


def _draws(cp, s, logits_np, n_draws, seed=1, history=None, **p):
    params, rng = s.make_sampler_state()
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
    base.update(p)
    s.set_sampler_params(params, rng, seed=seed, **base)
    n = logits_np.size
    logits = cp.asarray(logits_np.astype(np.float32)[None, :])
    hist = cp.asarray((history if history is not None else np.zeros(n, np.uint8))[None, :])
    tok = cp.full(1, -1, dtype=np.int32)
    out = cp.full(n_draws, -1, dtype=np.int32)
    for t in range(n_draws):
        if history is not None:
            hist[0] = cp.asarray(history)  # keep the presence mask fixed across draws
        s.sample(logits, params, rng, hist, tok)
        out[t] = tok[0]
    assert int(rng.get()[0, 1]) == n_draws, "the RNG step advances once per draw"
    return out.get(), hist.get()[0]


def test_masks_respected(kern, rng):
    import cupy as cp

    d, s = kern
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


def test_repetition_penalty_and_greedy(kern, rng):
    import cupy as cp

    d, s = kern
    x = rng.standard_normal(d.vocab).astype(np.float32)
    top = np.argsort(-x)[:3]
    seen = np.zeros(d.vocab, np.uint8)
    seen[top] = 1
    got, _ = _draws(cp, s, x, 5, history=seen, temperature=0.0, repetition_penalty=1.3)
    pen = np.where(seen > 0, np.where(x > 0, x / np.float32(1.3), x * np.float32(1.3)), x)
    assert (got == int(np.argmax(pen))).all()
    got, _ = _draws(cp, s, x, 100, history=seen, repetition_penalty=1e4, top_k=10)
    assert not set(got) & set(top), "heavily penalised seen ids are not drawn"


def test_seeded_reproducible(kern, rng):
    import cupy as cp

    d, s = kern
    x = (2 * rng.standard_normal(d.vocab)).astype(np.float32)
    a, _ = _draws(cp, s, x, 50, seed=1234, temperature=0.9, top_p=0.95)
    b, _ = _draws(cp, s, x, 50, seed=1234, temperature=0.9, top_p=0.95)
    c, _ = _draws(cp, s, x, 50, seed=4321, temperature=0.9, top_p=0.95)
    assert (a == b).all()
    assert (a != c).any()


@pytest.mark.parametrize("cfg", [dict(temperature=0.7), dict(temperature=1.0, top_k=8), dict(top_p=0.8)])
def test_distribution(gpu, cfg, rng):
    # once, on the tiny build: the kernel source is the same for every model; n is a run-time length
    import cupy as cp

    s = SamplingKernels(TINY, lambda src, defs: loader.load_module(src, defs))
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


def test_rows_of_a_batch_are_independent(kern, rng):
    """Rows with different params (greedy, greedy + penalty, top-k, top-p, min-p), seeds and histories in
    one launch: each row's token equals that row launched alone (same seed and step), and each row's
    step and history advance on their own."""
    import cupy as cp

    d, s = kern
    cfgs = [dict(temperature=0.0), dict(temperature=0.0, repetition_penalty=1.5), dict(temperature=0.9, top_k=20),
            dict(temperature=1.1, top_p=0.7), dict(temperature=0.8, min_p=0.1)]
    rows = len(cfgs)
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
    params = np.stack([pack_params(**{**base, **c}) for c in cfgs])
    seeds = rng.integers(0, 2**40, size=rows)
    steps = rng.integers(0, 5000, size=rows)
    rngs = np.stack([pack_rng(int(a), int(b)) for a, b in zip(seeds, steps, strict=True)])
    x = (3 * rng.standard_normal((rows, d.vocab))).astype(np.float32)
    hist = (rng.random((rows, d.vocab)) < 0.01).astype(np.uint8)
    dp, dr, dh = cp.asarray(params), cp.asarray(rngs), cp.asarray(hist)
    tok = cp.full(rows, -1, dtype=np.int32)
    s.sample(cp.asarray(x), dp, dr, dh, tok)
    batch = tok.get()
    assert (dr.get()[:, 1] == steps + 1).all()
    for b in range(rows):
        assert dh.get()[b, batch[b]] == 1, "the drawn id is marked in its own row"
        one = cp.full(1, -1, dtype=np.int32)
        s.sample(cp.asarray(x[b : b + 1]), cp.asarray(params[b : b + 1]), cp.asarray(rngs[b : b + 1]),
                 cp.asarray(hist[b : b + 1]), one)
        assert int(one.get()[0]) == batch[b], f"row {b} ({cfgs[b]})"
    assert batch[0] == int(np.argmax(x[0]))
    pen = np.where(hist[1] > 0, np.where(x[1] > 0, x[1] / np.float32(1.5), x[1] * np.float32(1.5)), x[1])
    assert batch[1] == int(np.argmax(pen))
