"""The int8 lm_head on the CPU: the numpy twins' rule (head_i8.py's module doc) and the launchers'
argument checks and launch shapes (test_launchers.py's method: fakes, nothing compiled or run)."""

import numpy as np
import pytest
from fakes import assert_each_refused, dev, load
from nanoqwen_kernels import KernelError
from nanoqwen_kernels.dims import QWEN25_1_5B, TINY
from nanoqwen_kernels.head_i8 import HeadI8Kernels, dequantize_head_i8, head_i8_logits, quantize_head_i8


def test_quantizer_rule(rng):
    n, k = 40, 512
    w = (0.05 * rng.standard_normal((n, k))).astype(np.float32)
    w *= np.exp2(rng.integers(-8, 6, size=(n, 1))).astype(np.float32)  # rows of very different size
    w[0, :128] = 0
    w[1, 128:256] = 1e-6  # the scale rounds to 0 in fp16: q = 0
    w[2, 0] = 127  # s = 1: the other values tie at .5 and round to even
    w[2, 1:128] = np.arange(127) - np.float32(63.5)
    w = w.astype(np.float16)
    q, s = quantize_head_i8(w)
    assert q.dtype == np.uint8 and q.shape == (n, k) and s.dtype == np.float16 and s.shape == (n, k // 128)
    assert q.min() >= 1 and q.max() <= 255  # q in -127..127
    wf = w.astype(np.float32).reshape(n, -1, 128)
    assert np.array_equal(s, (np.abs(wf).max(-1) / np.float32(127)).astype(np.float16))
    assert (q[0, :128] == 128).all() and s[1, 1] == 0 and (q[1, 128:256] == 128).all()
    assert (q[2, 1:128].astype(int) - 128 == [round(v) for v in np.arange(127) - 63.5]).all()  # banker's
    # every value within half a step of its group's scale, but for the clamp at 127 where the fp16 scale
    # rounded down (a subnormal scale: groups under 127 * 2^-14 in magnitude), and the largest near 127
    d = dequantize_head_i8(q, s).reshape(n, -1, 128)
    sf = s.astype(np.float32)[..., None]
    clamp = np.maximum(0, np.abs(wf).max(-1, keepdims=True) - 127 * sf)
    assert np.where(sf > 0, np.abs(d - wf) <= 0.5 * sf * (1 + 1e-6) + clamp, np.abs(wf) < 1e-5).all()
    assert (clamp[sf >= 2**-14] <= 0.07 * sf[sf >= 2**-14]).all()  # normal scales: 127 (1 + 2^-11) at most
    big = np.abs(wf).argmax(-1)
    assert (np.abs(np.take_along_axis(q.reshape(n, -1, 128), big[..., None], -1).astype(int) - 128)[sf > 0]
            >= 126).all()


def test_dequantize_and_logits(rng):
    n, k = 33, 256
    w = (0.02 * rng.standard_normal((n, k))).astype(np.float16)
    q, s = quantize_head_i8(w)
    f32 = dequantize_head_i8(q, s)
    f16 = dequantize_head_i8(q, s, np.float16)
    assert f32.dtype == np.float32 and np.array_equal(f16, f32.astype(np.float16))
    x = rng.standard_normal((3, k)).astype(np.float32)
    got = head_i8_logits(q, s, x)
    assert got.shape == (3, n) and np.allclose(got, x @ f32.T, rtol=1e-5, atol=1e-6)
    assert np.allclose(head_i8_logits(q, s, x[1]), got[1], rtol=1e-5, atol=1e-6)
    # the int8 head is close to the fp16 one, and not equal to it
    ref = x @ w.astype(np.float32).T
    err = np.abs(got - ref).max() / ref.std()
    assert 0 < err < 0.05


def test_twins_refuse_bad_shapes():
    with pytest.raises(KernelError, match="not a multiple of 128"):
        quantize_head_i8(np.zeros((2, 100), np.float16))
    with pytest.raises(KernelError, match="2-D float16"):
        quantize_head_i8(np.zeros((2, 128), np.float32))
    with pytest.raises(KernelError, match="expected q uint8"):
        dequantize_head_i8(np.zeros((2, 128), np.uint8), np.zeros((2, 2), np.float16))


@pytest.mark.parametrize("d", [TINY, QWEN25_1_5B], ids=["tiny", "1.5b"])
def test_launches(launches, d):
    h = HeadI8Kernels(d, load)
    n = 1001
    q, s = dev((n, d.hidden), np.uint8), dev((n, d.hidden // 128), np.float16)
    w = dev((n, d.hidden), np.float16)
    h.quantize_head_i8(w, q, s)
    fn, grid, args = launches[-1]
    assert fn == "nq_quantize_head_i8" and grid == -(-n * (d.hidden // 128) // 8) and int(args[-1]) == n
    h.dequantize_head_i8(q, s, w)
    assert launches[-1][0] == "nq_dequantize_head_i8" and launches[-1][1] == grid
    h.gemv_head_i8(q, s, dev((d.hidden,), np.float16), dev((n,), np.float32))
    fn, grid, args = launches[-1]
    assert fn == "nq_gemv_head_i8" and grid == -(-501 // 8) and int(args[-1]) == n
    h.gemv_head_i8(q, s, dev((1, d.hidden), np.float16), dev((1, n), np.float32))
    assert launches[-1][0] == "nq_gemv_head_i8"


def test_gemv_refuses_bad_arguments(launches):
    d = TINY
    h = HeadI8Kernels(d, load)
    n = 64
    good = dict(q=dev((n, d.hidden), np.uint8), s=dev((n, d.hidden // 128), np.float16),
                x=dev((d.hidden,), np.float16), out=dev((n,), np.float32))
    assert_each_refused(h.gemv_head_i8, good, [
        ({"q": dev((n, d.hidden), np.int8)}, "q must be uint8"),
        ({"q": dev((n, d.hidden + 128), np.uint8)}, r"q must be \[N, "),
        ({"s": dev((n, d.hidden // 128), np.float32)}, "s must be float16"),
        ({"s": dev((n - 1, d.hidden // 128), np.float16)}, "s must have shape"),
        ({"x": dev((2, d.hidden), np.float16), "out": dev((2, n), np.float32)}, "one row"),
        ({"x": dev((d.hidden + 8,), np.float16)}, "x must be"),
        ({"out": dev((n,), np.float16)}, "out must be float32"),
        ({"out": dev((1, n), np.float32)}, "out must have shape"),
    ])
    assert_each_refused(h.quantize_head_i8, dict(w=dev((n, d.hidden), np.float16), q_out=good["q"], s_out=good["s"]), [
        ({"w": dev((n + 1, d.hidden), np.float16)}, "w must have shape"),
        ({"w": dev((n, d.hidden), np.float32)}, "w must be float16"),
    ])
