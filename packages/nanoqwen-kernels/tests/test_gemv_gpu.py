"""GPU: the INT4 GEMV family and the fp16 lm_head GEMV against numpy references (refs.py).

Fresh random weights/activations each run; outputs poisoned with NaN before every launch. Tolerances:
the INT4 GEMV's products and 4-term partial sums are fp16 (refs.gemv_tolerance derives the bound);
RoPE'd q/k and silu*up are compared at 8 fp16 ulps of their own magnitude plus that bound; the fp16
lm_head accumulates in fp32 (4e-5 of the row's sqrt(sum (w x)^2) plus 1e-5 |ref|).
"""

import numpy as np
import pytest
from nanoqwen_kernels import loader
from nanoqwen_kernels.dims import QWEN25_7B, TINY, ModelDims
from nanoqwen_kernels.gemv import GemvKernels
from refs import dequant, gemv_tolerance, matvec, pack_valueshuffle, random_int4, rmsnorm, rope

pytestmark = pytest.mark.gpu
EPS = 1e-6
# an awkward shape too: 1.5B-like dims with more KV heads and odd head counts
ODD = ModelDims(
    hidden=1536, intermediate=8960, n_heads=12, n_kv_heads=2, head_dim=128, vocab=1000, n_layers=2
)
DIMS = {"tiny": TINY, "7b": QWEN25_7B, "odd": ODD}


# the default loop, and the opt-in tensor-core variant (gemv_int4_mma.cuh) exact and with the folded offset
VARIANTS = {"default": {}, "mma": {"NQ_GEMV_MMA": 1}, "mmaoff": {"NQ_GEMV_MMA": 1, "NQ_GEMV_MMA_OFFSET": 1}}


@pytest.fixture(scope="module", params=[(d, v) for d in sorted(DIMS) for v in VARIANTS], ids="-".join)
def kern(request, gpu):
    dname, vname = request.param
    d = DIMS[dname]
    return d, GemvKernels(d, lambda s, defs: loader.load_module(s, defs), VARIANTS[vname])


@pytest.fixture(scope="module", params=sorted(DIMS))
def kern16(request, gpu):
    """The lm_head GEMV does not depend on the INT4 variant: once per dims."""
    d = DIMS[request.param]
    return d, GemvKernels(d, lambda s, defs: loader.load_module(s, defs))


def _upload(cp, u, s):
    return cp.asarray(pack_valueshuffle(u)), cp.asarray(s)


def _check(got, ref, tol, what):
    got = np.asarray(got, dtype=np.float64)
    assert np.isfinite(got).all(), f"{what}: non-finite output (unwritten element?)"
    err = np.abs(got - ref)
    bad = err > tol
    assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} beyond tolerance, worst err {err.max():.3g}"


def _shapes(d):
    h, i = d.hidden, d.intermediate
    return [(h, h), (d.kv_dim, h), (h, i), (1, h), (3, h), (17, i), (2 * d.kv_dim + 1, h)]


@pytest.mark.parametrize("mode", ["plain", "residual", "norm", "norm_residual_inplace"])
def test_gemv_int4(kern, mode):
    import cupy as cp

    d, g = kern
    rng = np.random.default_rng()
    for n, k in _shapes(d):
        u, s = random_int4(rng, n, k)
        x = rng.standard_normal(k).astype(np.float16)
        w = (1 + 0.1 * rng.standard_normal(k)).astype(np.float16)
        res = rng.standard_normal(n).astype(np.float16)
        xin = rmsnorm(x, w, EPS) if "norm" in mode else x
        wd = dequant(u, s)
        ref = matvec(wd, xin)
        tol = gemv_tolerance(wd, xin, ref)
        if "residual" in mode:
            ref = ref + res.astype(np.float64)
            tol = tol + 2.0**-10 * np.abs(ref)
        qw, sc = _upload(cp, u, s)
        xd = cp.asarray(x)
        if mode == "norm_residual_inplace":
            out = cp.asarray(res)  # out is the residual: x_new = x + W.norm(h)
            g.gemv_int4(qw, sc, xd, out, residual=out, norm_w=cp.asarray(w), eps=EPS)
        else:
            out = cp.full(n, np.nan, dtype=np.float16)
            g.gemv_int4(
                qw,
                sc,
                xd,
                out,
                residual=cp.asarray(res) if "residual" in mode else None,
                norm_w=cp.asarray(w) if "norm" in mode else None,
                eps=EPS,
            )
        _check(out.get(), ref, tol, f"{mode} N={n} K={k}")


@pytest.mark.parametrize("pos", [0, 1, 15, 16, 17, 4095, 32767])
def test_qkv_rope_kv(kern, pos):
    import cupy as cp

    d, g = kern
    rng = np.random.default_rng()
    rows, H = d.qkv_rows, d.hidden
    u, s = random_int4(rng, rows, H)
    bias = (0.5 * rng.standard_normal(rows)).astype(np.float16)
    x = rng.standard_normal(H).astype(np.float16)
    w = (1 + 0.1 * rng.standard_normal(H)).astype(np.float16)
    n_layers, n_pages, layer = 3, 9, 1
    max_pages = pos // 16 + 2
    page_table = rng.integers(0, n_pages, size=max_pages).astype(np.int32)
    page_table[pos // 16] = rng.integers(0, n_pages)
    kc = cp.full((n_layers, n_pages, d.n_kv_heads, 16, 128), np.nan, dtype=np.float16)
    vc = cp.full_like(kc, np.nan)
    q_out = cp.full(d.q_dim, np.nan, dtype=np.float16)
    qw, sc = _upload(cp, u, s)
    g.qkv_rope_kv(
        qw,
        sc,
        cp.asarray(bias),
        cp.asarray(x),
        cp.asarray(w),
        EPS,
        cp.asarray([pos], dtype=np.int32),
        cp.asarray(page_table),
        kc,
        vc,
        layer,
        q_out,
    )

    xin = rmsnorm(x, w, EPS)
    wd = dequant(u, s)
    lin = matvec(wd, xin) + bias.astype(np.float64)
    tol = gemv_tolerance(wd, xin, lin)
    q, k, v = np.split(lin, [d.q_dim, d.q_dim + d.kv_dim])
    tq, tk, tv = np.split(tol, [d.q_dim, d.q_dim + d.kv_dim])
    qr = rope(q.reshape(d.n_heads, 128), pos, d.rope_theta).reshape(-1)
    kr = rope(k.reshape(d.n_kv_heads, 128), pos, d.rope_theta)
    # RoPE mixes d and d+64: either one's error can land on both
    halves = tq.reshape(-1, 2, 64)
    m = 2 * np.maximum(halves[:, 0], halves[:, 1])  # [heads, 64]
    tq = np.concatenate([m, m], axis=1).reshape(-1)
    _check(q_out.get(), qr, tq + 8 * 2.0**-11 * np.abs(qr), f"q pos={pos}")
    page, slot = page_table[pos // 16], pos % 16
    kh, vh = kc.get(), vc.get()
    tk2 = np.max(tk.reshape(d.n_kv_heads, 128), axis=1, keepdims=True) * 2 + 8 * 2.0**-11 * np.abs(kr)
    _check(kh[layer, page, :, slot], kr, tk2, f"k pos={pos}")
    _check(
        vh[layer, page, :, slot], v.reshape(d.n_kv_heads, 128), tv.reshape(d.n_kv_heads, 128), f"v pos={pos}"
    )
    # nothing else in either cache was written
    mask = np.ones(kh.shape, dtype=bool)
    mask[layer, page, :, slot] = False
    assert np.isnan(kh[mask]).all() and np.isnan(vh[mask]).all(), "a write outside the token's slot"


def test_gate_up_silu(kern):
    import cupy as cp

    d, g = kern
    rng = np.random.default_rng()
    H, inter = d.hidden, d.intermediate
    u, s = random_int4(rng, 2 * inter, H)
    x = rng.standard_normal(H).astype(np.float16)
    w = (1 + 0.1 * rng.standard_normal(H)).astype(np.float16)
    out = cp.full(inter, np.nan, dtype=np.float16)
    qw, sc = _upload(cp, u, s)
    g.gate_up_silu(qw, sc, cp.asarray(x), cp.asarray(w), EPS, out)
    xin = rmsnorm(x, w, EPS)
    wd = dequant(u, s)
    lin = matvec(wd, xin)
    tol = gemv_tolerance(wd, xin, lin)
    gate, up = lin[:inter], lin[inter:]
    silu = gate / (1 + np.exp(-gate))
    ref = silu * up
    # d(silu*up) = silu' up dgate + silu dup, |silu'| <= 1.1
    t = 1.1 * np.abs(up) * tol[:inter] + np.abs(silu) * tol[inter:] + 8 * 2.0**-11 * np.abs(ref) + 1e-6
    _check(out.get(), ref, t, "gate_up_silu")


@pytest.mark.parametrize("n", ["vocab", 1, 3, 1001])
def test_gemv_fp16(kern16, n):
    import cupy as cp

    d, g = kern16
    rng = np.random.default_rng()
    n = d.vocab if n == "vocab" else n
    w = (0.02 * rng.standard_normal((n, d.hidden), dtype=np.float32)).astype(np.float16)
    x = rng.standard_normal(d.hidden).astype(np.float16)
    out = cp.full(n, np.nan, dtype=np.float32)
    g.gemv_fp16(cp.asarray(w), cp.asarray(x), out)
    wf, xf = w.astype(np.float32), x.astype(np.float32)
    ref = matvec(wf, xf)
    spread = np.sqrt((wf * wf) @ (xf * xf)).astype(np.float64)
    tol = 4e-5 * spread + 1e-5 * np.abs(ref) + 1e-7
    _check(out.get(), ref, tol, f"gemv_fp16 N={n}")
