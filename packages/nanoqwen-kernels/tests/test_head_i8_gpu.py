"""GPU: the int8 lm_head (cuda/head_i8.cu) against its numpy twins (head_i8.py) and float64.

The quantizer and the dequantizer must give the numpy twins' bits exactly (the CPU reference backend
quantizes with the twin and must multiply the same values); the batch-1 GEMV is compared with the float64
product of the dequantized head at a bound on fp32 summation (4e-6 of the row's sqrt(sum (w x)^2) plus
1e-6 |ref|: 16-term fp32 piece sums, scaled, then summed across 7 pieces and 32 lanes). Fresh random
inputs (the seeded `rng` fixture), outputs poisoned with NaN (0xFF bytes for q) before every launch, at
the 7B, 1.5B and tiny dims, over the full vocabulary and an odd row count.
"""

import numpy as np
import pytest
from nanoqwen_kernels import loader
from nanoqwen_kernels.dims import PRESETS
from nanoqwen_kernels.errors import KernelError
from nanoqwen_kernels.head_i8 import HeadI8Kernels, dequantize_head_i8, quantize_head_i8

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=sorted(PRESETS))
def dims(request):
    return PRESETS[request.param]


@pytest.fixture(scope="module")
def head(dims, gpu):
    return HeadI8Kernels(dims, loader.load_module)


def _weights(rng, n, k):
    """An fp16 head with what a quantizer must get right: a zero group, a tiny group (its fp16 scale
    rounds to 0), a group whose values tie at .5 of the scale, and rows of very different magnitudes."""
    w = (0.02 * rng.standard_normal((n, k), dtype=np.float32))
    w *= np.exp2(rng.integers(-6, 4, size=(n, 1))).astype(np.float32)
    w[0, :128] = 0
    w[1, :128] = 1e-6  # amax / 127 under fp16's smallest subnormal: s = 0, q = 0
    w[2, 0] = 127  # s = 1 exactly, so the other 127 values -63.5 .. 62.5 tie at .5 (rint: to even)
    w[2, 1:128] = np.arange(127) - np.float32(63.5)
    return w.astype(np.float16)


@pytest.mark.parametrize("rows", ["vocab", 1001])
def test_quantize_and_dequantize_match_the_twins_bit_for_bit(head, dims, rng, rows):
    import cupy as cp

    n = dims.vocab if rows == "vocab" else rows
    w = _weights(rng, n, dims.hidden)
    q = cp.full((n, dims.hidden), 0xFF, dtype=np.uint8)
    s = cp.full((n, dims.hidden // 128), np.nan, dtype=np.float16)
    head.quantize_head_i8(cp.asarray(w), q, s)
    q_ref, s_ref = quantize_head_i8(w)
    assert np.array_equal(s.get().view(np.uint16), s_ref.view(np.uint16))
    assert np.array_equal(q.get(), q_ref)
    assert (q_ref[0, :128] == 128).all() and (q_ref[1, :128] == 128).all()
    out = cp.full((n, dims.hidden), np.nan, dtype=np.float16)
    head.dequantize_head_i8(q, s, out)
    assert np.array_equal(out.get().view(np.uint16), dequantize_head_i8(q_ref, s_ref, np.float16).view(np.uint16))
    # the values are the head's to int8 precision: within half a scale step of w
    err = np.abs(dequantize_head_i8(q_ref, s_ref) - w.astype(np.float32)).reshape(n, -1, 128)
    sf = s_ref.astype(np.float32)[..., None]
    clamp = np.maximum(0, np.abs(w.astype(np.float32)).reshape(n, -1, 128).max(-1, keepdims=True) - 127 * sf)
    assert np.where(sf > 0, err <= 0.5 * sf * (1 + 1e-6) + clamp, err < 1e-5).all()  # clamp: subnormal s
    assert s_ref[2, 0] == 1 and (q_ref[2, 1:128].astype(int) - 128 == np.rint(np.arange(127) - 63.5)).all()


@pytest.mark.parametrize("rows", ["vocab", 1001, 7])
@pytest.mark.parametrize("one_d", [True, False])
def test_gemv_matches_float64(head, dims, rng, rows, one_d):
    import cupy as cp

    n = dims.vocab if rows == "vocab" else rows
    q_ref, s_ref = quantize_head_i8(_weights(rng, n, dims.hidden))
    x = (2 * rng.standard_normal(dims.hidden)).astype(np.float16)
    out = cp.full((n,) if one_d else (1, n), np.nan, dtype=np.float32)
    xd = cp.asarray(x) if one_d else cp.asarray(x)[None, :]
    head.gemv_head_i8(cp.asarray(q_ref), cp.asarray(s_ref), xd, out)
    got = out.get().reshape(n)
    wf = dequantize_head_i8(q_ref, s_ref).astype(np.float64)
    xf = x.astype(np.float64)
    ref = wf @ xf
    tol = 4e-6 * np.sqrt(np.square(wf) @ np.square(xf)) + 1e-6 * np.abs(ref) + 1e-12
    bad = ~(np.abs(got - ref) <= tol)
    assert not bad.any(), f"{bad.sum()} of {n} logits off, first at {np.flatnonzero(bad)[:5]}"


def test_gemv_repeats_its_bits_and_refuses_batches(head, dims, rng):
    import cupy as cp

    n = 4097
    q, s = (cp.asarray(a) for a in quantize_head_i8(_weights(rng, n, dims.hidden)))
    x = cp.asarray(rng.standard_normal(dims.hidden).astype(np.float16))
    a = cp.full(n, np.nan, dtype=np.float32)
    b = cp.full(n, np.nan, dtype=np.float32)
    head.gemv_head_i8(q, s, x, a)
    head.gemv_head_i8(q, s, x, b)
    assert np.array_equal(a.get().view(np.uint32), b.get().view(np.uint32))
    with pytest.raises(KernelError, match="one row"):
        head.gemv_head_i8(q, s, cp.zeros((2, dims.hidden), dtype=np.float16), cp.zeros((2, n), dtype=np.float32))
    with pytest.raises(KernelError, match="s must have shape"):
        head.gemv_head_i8(q, s[:-1], x, a)
