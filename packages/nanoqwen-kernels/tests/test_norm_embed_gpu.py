"""GPU: rmsnorm / rmsnorm_rows and embed against numpy, for one row and for batches. RMSNorm is compared at
2 fp16 ulps of the result (the kernel and numpy sum squares in different orders, so r may differ in its
last fp32 bit; that can flip the rounding of fp16(x r) by one ulp, and the weight multiply, |w| up to ~1.6
here, carries it into up to two ulps of the output: seen on the H200, docs/VALIDATION.md); embed is an
exact copy."""

import numpy as np
import pytest
from nanoqwen_kernels import loader
from nanoqwen_kernels.dims import QWEN25_7B, TINY
from nanoqwen_kernels.embed import EmbedKernels
from nanoqwen_kernels.norm import NormKernels
from refs import rmsnorm

pytestmark = pytest.mark.gpu
DIMS = {"tiny": TINY, "7b": QWEN25_7B}


def _load(sources, defines):
    return loader.load_module(sources, defines)


@pytest.fixture(scope="module", params=sorted(DIMS))
def kern(request, gpu):
    d = DIMS[request.param]
    return d, NormKernels(d, _load)


@pytest.fixture(scope="module", params=sorted(DIMS))
def embed_kern(request, gpu):
    d = DIMS[request.param]
    return d, EmbedKernels(d, _load)


def _ulp_close(got, ref):
    got, ref = np.asarray(got, np.float32), ref.astype(np.float32)
    assert np.isfinite(got).all(), "unwritten (NaN) output"
    tol = np.abs(ref) * 2.0**-9 + 2.0**-23
    bad = np.abs(got - ref) > tol
    assert not bad.any(), f"{bad.sum()} elements beyond 2 ulps; worst {np.abs(got - ref).max()}"


@pytest.mark.parametrize("T", [1, 3, 17, 64])
def test_rmsnorm_rows(kern, rng, T):
    import cupy as cp

    d, n = kern
    x = (rng.standard_normal((T, d.hidden)) * rng.uniform(0.1, 30, size=(T, 1))).astype(np.float16)
    w = (1 + 0.2 * rng.standard_normal(d.hidden)).astype(np.float16)
    out = cp.full((T, d.hidden), np.nan, dtype=np.float16)
    n.rmsnorm_rows(cp.asarray(x), cp.asarray(w), out, 1e-6)
    _ulp_close(out.get(), rmsnorm(x, w, 1e-6))
    xd = cp.asarray(x)
    n.rmsnorm_rows(xd, cp.asarray(w), xd, 1e-6)  # in place
    _ulp_close(xd.get(), rmsnorm(x, w, 1e-6))


def test_rmsnorm_single(kern, rng):
    import cupy as cp

    d, n = kern
    x = rng.standard_normal(d.hidden).astype(np.float16)
    w = rng.standard_normal(d.hidden).astype(np.float16)
    out = cp.full(d.hidden, np.nan, dtype=np.float16)
    n.rmsnorm(cp.asarray(x), cp.asarray(w), out, 1e-5)
    _ulp_close(out.get(), rmsnorm(x[None], w, 1e-5)[0])


@pytest.mark.parametrize("b", [1, 5, 64])
def test_embed(embed_kern, rng, b):
    import cupy as cp

    d, e = embed_kern
    table = rng.standard_normal((d.vocab, d.hidden), dtype=np.float32).astype(np.float16)
    td = cp.asarray(table)
    ids = rng.integers(0, d.vocab, size=b).astype(np.int32)
    ids[0] = d.vocab - 1
    if b > 1:
        ids[1] = 0
    out = cp.full((b, d.hidden), np.nan, dtype=np.float16)
    e.embed(td, cp.asarray(ids), out if b > 1 else out[0])
    np.testing.assert_array_equal(out.get(), table[ids])
    # ids outside [0, V) give NaN rows; the other rows are untouched by them
    bad = ids.copy()
    bad[0] = -1
    if b > 1:
        bad[-1] = d.vocab
    out = cp.zeros((b, d.hidden), dtype=np.float16)
    e.embed(td, cp.asarray(bad), out if b > 1 else out[0])
    got = out.get()
    for j, tok in enumerate(bad):
        if 0 <= tok < d.vocab:
            np.testing.assert_array_equal(got[j], table[tok])
        else:
            assert np.isnan(got[j]).all(), f"id {tok} out of range must give a NaN row"
