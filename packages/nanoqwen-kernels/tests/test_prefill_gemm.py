"""Prefill INT4 GEMM on the GPU: the dequantizer bit-exact, the GEMMs (the fused wgmma one, gemm_int4_wg, and
dequantize + cuBLAS, gemm_int4) against a float64 reference.

The ValueShuffle-v1 packer (refs.py) is written from docs/INTERFACES.md section 2 (kernels never import
format), so these tests also check that the kernel reads the contract, not a private convention.
Tolerances: dequantize_int4 is exact (one rounding of an exact product, as numpy's
float32 -> fp16: a fp16 scale times an integer in [-8, 7] is exact in float32);
gemm_int4 (fp16 output, fp32 accumulate): |out - ref| <= 2e-3 |ref| + 2e-3 rms(ref).
"""

import numpy as np
import pytest
from nanoqwen_kernels import gpu_status
from nanoqwen_kernels.dims import QWEN25_7B, TINY
from refs import dequant, pack_valueshuffle, random_int4

OK, REASON = gpu_status()
gpu = pytest.mark.skipif(not OK, reason=REASON)


def int4_weight(rng, n, k):
    """(qweight as stored, fp16 scales, the fp16 weight they stand for: one rounding of an exact product)."""
    u, s = random_int4(rng, n, k, scale=0.1)
    return pack_valueshuffle(u), s, dequant(u, s).astype(np.float16)


@pytest.fixture(scope="module")
def kernels():
    from nanoqwen_kernels.loader import load_module
    from nanoqwen_kernels.prefill import PrefillKernels

    return {"7b": PrefillKernels(QWEN25_7B, load_module), "tiny": PrefillKernels(TINY, load_module)}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(512, 3584), (3584, 3584), (3, 128), (512, 256)])
def test_dequantize_is_exact(kernels, rng, n, k):
    import cupy as cp

    qw, sc, w = int4_weight(rng, n, k)
    out = cp.full((n, k), np.nan, dtype=cp.float16)
    kernels["7b"].dequantize_int4(cp.asarray(qw), cp.asarray(sc), out)
    got = cp.asnumpy(out)
    assert np.array_equal(got.view(np.uint16), w.view(np.uint16)), (
        f"{np.count_nonzero(got != w)} of {w.size} values differ"
    )


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 15, 16, 17, 100, 513])
@pytest.mark.parametrize("name,n,k", [("7b", 512, 3584), ("7b", 3584, 3584), ("tiny", 1024, 256)])
def test_gemm_matches_reference(kernels, rng, T, name, n, k):
    import cupy as cp

    qw, sc, w = int4_weight(rng, n, k)
    x = rng.standard_normal((T, k)).astype(np.float16)
    out = cp.full((T, n), np.nan, dtype=cp.float16)
    ws = cp.full(n * k, np.nan, dtype=cp.float16)
    kernels[name].gemm_int4(cp.asarray(qw), cp.asarray(sc), cp.asarray(x), out, workspace=ws)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    got = cp.asnumpy(out).astype(np.float64)
    tol = 2e-3 * np.abs(ref) + 2e-3 * np.sqrt(np.mean(ref**2))
    assert np.isfinite(got).all()
    assert (np.abs(got - ref) <= tol).all(), f"max err {np.abs(got - ref).max():.3g}"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 17, 513])
def test_gemm_accumulates_into_out(kernels, rng, T):
    """accumulate=True: out = X W^T + out (the prefill's residual add, cuBLAS beta = 1), one fp16 rounding."""
    import cupy as cp

    n, k = 3584, 3584
    qw, sc, w = int4_weight(rng, n, k)
    x = rng.standard_normal((T, k)).astype(np.float16)
    res = (4 * rng.standard_normal((T, n))).astype(np.float16)
    out = cp.asarray(res)
    kernels["7b"].gemm_int4(cp.asarray(qw), cp.asarray(sc), cp.asarray(x), out, accumulate=True)
    ref = x.astype(np.float64) @ w.astype(np.float64).T + res.astype(np.float64)
    got = cp.asnumpy(out).astype(np.float64)
    tol = 2e-3 * np.abs(ref) + 2e-3 * np.sqrt(np.mean(ref**2))
    assert np.isfinite(got).all()
    assert (np.abs(got - ref) <= tol).all(), f"max err {np.abs(got - ref).max():.3g}"
    # and without accumulate the residual is gone (out overwritten, beta = 0)
    kernels["7b"].gemm_int4(cp.asarray(qw), cp.asarray(sc), cp.asarray(x), out)
    ref0 = ref - res.astype(np.float64)
    assert (np.abs(cp.asnumpy(out).astype(np.float64) - ref0) <= tol).all()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 17, 70])
def test_gemm_f16_is_gemm_int4_on_the_dequantized_weight(kernels, rng, T):
    """gemm_f16 on dequantize_int4's output gives gemm_int4's bits (the same cuBLAS call on the same fp16
    weight), with and without accumulate."""
    import cupy as cp

    qw, sc, _ = int4_weight(rng, 512, 3584)
    qw, sc = cp.asarray(qw), cp.asarray(sc)
    w = cp.empty((512, 3584), dtype=cp.float16)
    kernels["7b"].dequantize_int4(qw, sc, w)
    X = cp.asarray(rng.standard_normal((T, 3584)).astype(np.float16))
    base = rng.standard_normal((T, 512)).astype(np.float16)
    for acc in (False, True):
        a, b = cp.asarray(base), cp.asarray(base)
        kernels["7b"].gemm_int4(qw, sc, X, a, accumulate=acc)
        kernels["7b"].gemm_f16(w, X, b, accumulate=acc)
        assert np.array_equal(cp.asnumpy(a).view(np.uint16), cp.asnumpy(b).view(np.uint16))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["7b", "tiny"])
@pytest.mark.parametrize("T", [1, 17, 70])
def test_silu_mul(kernels, rng, name, T):
    """out = silu(gate) * up in fp32, one rounding: within an fp16 ulp of the float64 value (plus __expf's
    error); every element written."""
    import cupy as cp

    d = QWEN25_7B if name == "7b" else TINY
    i = d.intermediate
    gu = (3 * rng.standard_normal((T, 2 * i))).astype(np.float16)
    out = cp.full((T, i), np.nan, dtype=cp.float16)
    kernels[name].silu_mul(cp.asarray(gu), out)
    g, u = gu[:, :i].astype(np.float64), gu[:, i:].astype(np.float64)
    ref = g / (1 + np.exp(-g)) * u
    got = cp.asnumpy(out).astype(np.float64)
    assert np.isfinite(got).all()
    assert (np.abs(got - ref) <= 1e-3 * np.abs(ref) + 1e-6).all()


WG_SHAPES = [  # (dims, N, K): 7B q/k/v, a slice of gate|up's rows, down's K; the 1.5B's; tiny's (K = 256)
    ("7b", 4608, 3584), ("7b", 1024, 3584), ("7b", 640, 18944), ("1.5b", 2048, 1536), ("1.5b", 512, 8960),
    ("tiny", 1024, 256), ("tiny", 136, 384),
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 17, 511, 513])
@pytest.mark.parametrize("name,n,k", WG_SHAPES)
def test_gemm_int4_wg_matches_reference(kernels, rng, T, name, n, k):
    """The fused INT4 GEMM at awkward T (a partial token tile on each side of 512), rows not a multiple of
    the 128-row tile (136), an odd group count (K = 384), every tile width, split-K (2 and K / 256 splits,
    uneven group counts per split): float64 within the tolerance, every output written (NaN poison in out
    and in the split-K workspace)."""
    import cupy as cp

    qw, sc, w = int4_weight(rng, n, k)
    x = rng.standard_normal((T, k)).astype(np.float16)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    tol = 2e-3 * np.abs(ref) + 2e-3 * np.sqrt(np.mean(ref**2))
    qd, sd, xd = cp.asarray(qw), cp.asarray(sc), cp.asarray(x)
    plans = [(None, None), (256, 1), (128, 1), (64, 1), (64, 2), (256, k // 256)]
    for tile, splits in plans:
        out = cp.full((T, n), np.nan, dtype=cp.float16)
        # poisoned partial sums (the chosen plan's workspace comes from the pool)
        ws = cp.full(splits * T * n, np.nan, dtype=cp.float32) if splits else None
        kernels["7b"].gemm_int4_wg(qd, sd, xd, out, tile=tile, splits=splits, workspace=ws)
        got = cp.asnumpy(out).astype(np.float64)
        plan = f"tile {tile} splits {splits}"
        assert np.isfinite(got).all(), f"{plan}: {np.count_nonzero(~np.isfinite(got))} outputs not written"
        assert (np.abs(got - ref) <= tol).all(), f"{plan}: max err {np.abs(got - ref).max():.3g}"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 17, 513])
def test_gemm_int4_wg_accumulates_into_out(kernels, rng, T):
    """accumulate=True: out = X W^T + out in fp32, one rounding (the residual add), in one launch and with
    split-K (the reduction adds it); the residual's rows and columns stay paired (a transposed epilogue
    would mix them)."""
    import cupy as cp

    n, k = 3584, 3584
    qw, sc, w = int4_weight(rng, n, k)
    x = rng.standard_normal((T, k)).astype(np.float16)
    res = (4 * rng.standard_normal((T, n))).astype(np.float16)
    ref = x.astype(np.float64) @ w.astype(np.float64).T + res.astype(np.float64)
    tol = 2e-3 * np.abs(ref) + 2e-3 * np.sqrt(np.mean(ref**2))
    for splits in (1, 3):
        out = cp.asarray(res)
        kernels["7b"].gemm_int4_wg(cp.asarray(qw), cp.asarray(sc), cp.asarray(x), out, accumulate=True,
                                   splits=splits)
        got = cp.asnumpy(out).astype(np.float64)
        assert (np.abs(got - ref) <= tol).all(), f"splits {splits}: max err {np.abs(got - ref).max():.3g}"


@gpu
@pytest.mark.gpu
def test_gemm_int4_wg_agrees_with_cublas_path(kernels, rng):
    """Both prefill GEMMs on one weight: the same fp16 weight values, fp32 sums in a different order, so
    they agree to fp16 rounding of the outputs (a few ulps), not bit for bit."""
    import cupy as cp

    n, k, T = 1024, 3584, 300
    qw, sc, _ = int4_weight(rng, n, k)
    x = cp.asarray(rng.standard_normal((T, k)).astype(np.float16))
    a = cp.full((T, n), np.nan, dtype=cp.float16)
    b = cp.full((T, n), np.nan, dtype=cp.float16)
    kernels["7b"].gemm_int4_wg(cp.asarray(qw), cp.asarray(sc), x, a)
    kernels["7b"].gemm_int4(cp.asarray(qw), cp.asarray(sc), x, b)
    a64, b64 = cp.asnumpy(a).astype(np.float64), cp.asnumpy(b).astype(np.float64)
    assert (np.abs(a64 - b64) <= 4e-3 * np.abs(b64) + 1e-3 * np.sqrt(np.mean(b64**2))).all()



@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 17, 511, 513])
@pytest.mark.parametrize("name,i,k", [("7b", 512, 3584), ("1.5b", 640, 1536), ("tiny", 512, 256), ("tiny", 64, 384)])
def test_gemm_int4_wg_silu_matches_reference(kernels, rng, T, name, i, k):
    """The gate|up GEMM with SiLU(gate) * up in its epilogue: against float64 (silu of the exact gate sum
    times the exact up sum) at awkward T, every tile width, every output written (NaN poison)."""
    import cupy as cp

    qw, sc, w = int4_weight(rng, 2 * i, k)
    x = rng.standard_normal((T, k)).astype(np.float16)
    gu = x.astype(np.float64) @ w.astype(np.float64).T
    g, u = gu[:, :i], gu[:, i:]
    ref = g / (1 + np.exp(-g)) * u
    tol = 3e-3 * np.abs(ref) + 3e-3 * np.sqrt(np.mean(ref**2))
    qd, sd, xd = cp.asarray(qw), cp.asarray(sc), cp.asarray(x)
    for tile in (None, 256, 128, 64):
        out = cp.full((T, i), np.nan, dtype=cp.float16)
        kernels["7b"].gemm_int4_wg_silu(qd, sd, xd, out, tile=tile)
        got = cp.asnumpy(out).astype(np.float64)
        assert np.isfinite(got).all(), f"tile {tile}: {np.count_nonzero(~np.isfinite(got))} outputs not written"
        assert (np.abs(got - ref) <= tol).all(), f"tile {tile}: max err {np.abs(got - ref).max():.3g}"
