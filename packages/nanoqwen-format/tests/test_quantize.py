"""quantize_int4 against a plain per-group loop written here from docs/FORMAT.md section 5."""

import numpy as np
import pytest
from nanoqwen_format import NanoqwenFormatError, dequantize_int4, quantize_int4


def reference_quantize(w: np.ndarray):
    """Group by group, element by element where it matters: s = fp16(max|w|/7), q = clamp(rint(w/s))."""
    n, k = w.shape
    u = np.zeros((n, k), np.uint8)
    scales = np.zeros((n, k // 128), np.float16)
    for r in range(n):
        for g in range(k // 128):
            grp = w[r, g * 128:(g + 1) * 128].astype(np.float32)
            s = np.float16(np.float32(np.max(np.abs(grp))) / np.float32(7))
            scales[r, g] = s
            for j, x in enumerate(grp):
                q = 0 if s == 0 else min(7, max(-8, int(np.rint(np.float32(x) / np.float32(s)))))
                u[r, g * 128 + j] = q + 8
    return u, scales


@pytest.mark.parametrize("shape", [(1, 128), (3, 256), (5, 384)])
def test_matches_reference_bit_for_bit(shape, rng):
    w = (rng.standard_normal(shape) * rng.uniform(1e-3, 10)).astype(np.float32)
    u, s = quantize_int4(w)
    ru, rs = reference_quantize(w)
    assert u.dtype == np.uint8 and s.dtype == np.float16
    np.testing.assert_array_equal(s.view(np.uint16), rs.view(np.uint16))
    np.testing.assert_array_equal(u, ru)


def test_error_at_most_half_a_step(rng):
    w = (rng.standard_normal((64, 1024)) * rng.uniform(0.01, 3, size=(64, 1))).astype(np.float32)
    u, s = quantize_int4(w)
    err = np.abs(w.astype(np.float64) - dequantize_int4(u, s).astype(np.float64))
    half_step = np.repeat(s.astype(np.float64), 128, axis=1) / 2
    assert np.all(err <= half_step * (1 + 1e-6))
    assert u.min() >= 1 and u.max() <= 15  # symmetric: q = -8 is never produced by rounding


def test_zero_groups_and_extremes(rng):
    w = rng.standard_normal((4, 512)).astype(np.float32)
    w[0, :128] = 0  # an all-zero group: s = 0, every q = 0 (u = 8), no NaN from 0/0
    w[1, 128:256] = 0
    w[1, 130] = 65504.0 * 3  # large but within fp16 after /7
    w[2, 256:384] = -1e-3
    w[3, 384] = -7.0
    u, s = quantize_int4(w)
    assert s[0, 0] == 0 and np.all(u[0, :128] == 8)
    assert np.all(np.isfinite(s))
    assert u[1, 130] == 15 and np.all(u[1, 128:130] == 8)  # max -> q = 7; zeros stay 0
    assert np.all(u[2, 256:384] == 1)  # a constant negative group -> q = -7
    assert s[3, 3] == 1 and u[3, 384] == 1  # max|w| = 7 -> s = 1 exactly, q = -7
    wq = dequantize_int4(u, s)
    assert np.all(wq[0, :128] == 0)
    np.testing.assert_allclose(wq[1, 130], w[1, 130], rtol=1e-3)


def test_refuses_bad_input():
    with pytest.raises(NanoqwenFormatError, match="multiple of 128"):
        quantize_int4(np.zeros((2, 100), np.float32))
    with pytest.raises(NanoqwenFormatError, match="inf or NaN"):
        quantize_int4(np.full((1, 128), np.nan, np.float32))
    with pytest.raises(NanoqwenFormatError, match="overflows float16"):
        quantize_int4(np.full((1, 128), 1e7, np.float32))
