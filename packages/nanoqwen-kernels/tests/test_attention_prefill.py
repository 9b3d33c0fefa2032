"""Causal prefill attention over the pages on the GPU against a numpy float64 reference.

Positions 0 .. start_pos+T-1 hold random K/V in pages scattered through the pool; every other slot
(other pages, the other layer, the last page's slots past the sequence) is NaN; out starts NaN.
Tolerance (fp16 output, fp32 softmax/accumulation): |out - ref| <= 2e-4 + 4e-3 |ref|; the tensor-core
body ("mma") also rounds the probabilities to fp16 before P.V (as FlashAttention does), which moves an
output by at most 2^-11 sum_j p_j |v_j| (p normalised): that term, with a 25% margin, is added for it
(without it the tensor-core body's errors, up to 1.4e-3, exceed the fp32 bound: docs/VALIDATION.md).
"""

import numpy as np
import pytest
from nanoqwen_kernels import gpu_status
from nanoqwen_kernels.dims import QWEN25_7B, TINY
from refs import scattered_pages

OK, REASON = gpu_status()
gpu = pytest.mark.skipif(not OK, reason=REASON)
DIMS = {"7b": QWEN25_7B, "tiny": TINY}


VARIANTS = ["fma", "wg"]  # attention bodies (nanoqwen_kernels.prefill.ATTENTION_VARIANTS)


@pytest.fixture(scope="module")
def kernels():
    from nanoqwen_kernels.loader import load_module
    from nanoqwen_kernels.prefill import PrefillKernels

    return {(name, v): PrefillKernels(d, load_module, v) for name, d in DIMS.items() for v in VARIANTS}


P_ROUNDING = 1.25 * 2.0**-11  # fp16 rounding of p in [0, 1] (relative), with a margin


def causal_ref(q, k, v, start_pos, g, with_pv_abs=False):
    """q [T, nh, 128], k/v [L, nkv, 128] float64 -> [T, nh, 128]; query i sees positions <= start_pos+i.

    with_pv_abs: also return P.|V| (the scale of the fp16 P-rounding error of the tensor-core body)."""
    T, nh, _ = q.shape
    out = np.empty_like(q)
    pv_abs = np.empty_like(q)
    for h in range(nh):
        s = q[:, h, :] @ k[:, h // g, :].T / np.sqrt(128.0)  # [T, L]
        mask = np.arange(k.shape[0])[None, :] > (start_pos + np.arange(T))[:, None]
        s[mask] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        out[:, h, :] = p @ v[:, h // g, :]
        pv_abs[:, h, :] = p @ np.abs(v[:, h // g, :])
    return (out, pv_abs) if with_pv_abs else out


def tolerance(ref, pv_abs, variant):
    tol = 2e-4 + 4e-3 * np.abs(ref)
    return tol + P_ROUNDING * pv_abs if variant != "fma" else tol  # tensor-core bodies round P to fp16


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", ["7b", "tiny"])
@pytest.mark.parametrize("start_pos", [0, 37])
@pytest.mark.parametrize("T", [1, 15, 16, 17, 100, 513])
def test_attention_prefill(kernels, rng, name, start_pos, T, variant):
    import cupy as cp

    d = DIMS[name]
    L = start_pos + T
    table, n_pages = scattered_pages(rng, L)
    shape = (2, n_pages, d.n_kv_heads, 16, 128)
    kc = np.full(shape, np.nan, dtype=np.float16)
    vc = np.full(shape, np.nan, dtype=np.float16)
    k = rng.standard_normal((L, d.n_kv_heads, 128)).astype(np.float16)
    v = rng.standard_normal((L, d.n_kv_heads, 128)).astype(np.float16)
    layer = 1
    pos = np.arange(L)
    kc[layer, table[pos // 16], :, pos % 16] = k
    vc[layer, table[pos // 16], :, pos % 16] = v
    q = (2.0 * rng.standard_normal((T, d.q_dim))).astype(np.float16)
    out = cp.full((T, d.q_dim), np.nan, dtype=cp.float16)
    kernels[name, variant].attention_prefill(
        cp.asarray(q), cp.asarray(kc), cp.asarray(vc), cp.asarray(table), start_pos, T, layer, out
    )
    g = d.n_heads // d.n_kv_heads
    ref, pv_abs = causal_ref(
        q.astype(np.float64).reshape(T, d.n_heads, 128),
        k.astype(np.float64),
        v.astype(np.float64),
        start_pos,
        g,
        with_pv_abs=True,
    )
    ref, pv_abs = ref.reshape(T, -1), pv_abs.reshape(T, -1)
    got = cp.asnumpy(out).astype(np.float64)
    assert np.isfinite(got).all(), "NaN in the output: a slot outside the sequence was read"
    err = np.abs(got - ref)
    tol = tolerance(ref, pv_abs, variant)
    assert (err <= tol).all(), f"max err {err.max():.3g}, worst excess {(err - tol).max():.3g}"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_attention_prefill_32k_rows(kernels, rng, variant):
    """T = 32768 in one launch (O(T) memory): 24 random rows, the first and the last, against the reference."""
    import cupy as cp

    d, T = TINY, 32768
    n_pages = T // 16
    table = rng.permutation(n_pages).astype(np.int32)
    pos = np.arange(T)
    k = rng.standard_normal((T, d.n_kv_heads, 128)).astype(np.float16)
    v = rng.standard_normal((T, d.n_kv_heads, 128)).astype(np.float16)
    kc = np.empty((1, n_pages, d.n_kv_heads, 16, 128), np.float16)
    vc = np.empty_like(kc)
    kc[0, table[pos // 16], :, pos % 16] = k
    vc[0, table[pos // 16], :, pos % 16] = v
    q = rng.standard_normal((T, d.q_dim)).astype(np.float16)
    out = cp.full((T, d.q_dim), np.nan, dtype=cp.float16)
    kernels["tiny", variant].attention_prefill(
        cp.asarray(q), cp.asarray(kc), cp.asarray(vc), cp.asarray(table), 0, T, 0, out
    )
    got = cp.asnumpy(out).astype(np.float64)
    assert np.isfinite(got).all()
    rows = np.concatenate([[0, T - 1], rng.integers(0, T, 22)])
    g = d.n_heads // d.n_kv_heads
    kf, vf = k.astype(np.float64), v.astype(np.float64)
    for i in rows:
        qi = q[i].astype(np.float64).reshape(1, d.n_heads, 128)
        # row i alone: start_pos = i makes it see positions 0..i, exactly its causal window
        ref, pv_abs = causal_ref(qi, kf[: i + 1], vf[: i + 1], int(i), g, with_pv_abs=True)
        ref, pv_abs = ref.reshape(-1), pv_abs.reshape(-1)
        assert (np.abs(got[i] - ref) <= tolerance(ref, pv_abs, variant)).all(), f"row {i}"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("start_pos", "T", "bucket"), [(0, 1, 16), (37, 17, 64), (3, 100, 128)])
def test_attention_prefill_from_device_ctl(kernels, rng, variant, start_pos, T, bucket):
    """ctl = (start_pos, T) on the device over a launch of `bucket` rows (a captured prefill graph's form):
    the T real rows are the host-scalar launch's bits; the padding rows are not written (still NaN) and no
    slot past the sequence is read (the pages past it are NaN, the table ends with the sequence)."""
    import cupy as cp

    d = DIMS["tiny"]
    L = start_pos + T
    table, n_pages = scattered_pages(rng, L)
    shape = (2, n_pages, d.n_kv_heads, 16, 128)
    kc = np.full(shape, np.nan, dtype=np.float16)
    vc = np.full(shape, np.nan, dtype=np.float16)
    pos = np.arange(L)
    kc[1, table[pos // 16], :, pos % 16] = rng.standard_normal((L, d.n_kv_heads, 128)).astype(np.float16)
    vc[1, table[pos // 16], :, pos % 16] = rng.standard_normal((L, d.n_kv_heads, 128)).astype(np.float16)
    q = cp.asarray((2.0 * rng.standard_normal((bucket, d.q_dim))).astype(np.float16))
    args = (cp.asarray(kc), cp.asarray(vc), cp.asarray(table))
    ref = cp.full((T, d.q_dim), np.nan, dtype=cp.float16)
    kernels["tiny", variant].attention_prefill(q[:T], *args, start_pos, T, 1, ref)
    got = cp.full((bucket, d.q_dim), np.nan, dtype=cp.float16)
    ctl = cp.asarray(np.array([start_pos, T], dtype=np.int32))
    kernels["tiny", variant].attention_prefill(q, *args, None, bucket, 1, got, ctl=ctl)
    got, ref = cp.asnumpy(got), cp.asnumpy(ref)
    assert np.isfinite(ref).all()
    assert np.array_equal(got[:T].view(np.uint16), ref.view(np.uint16))
    assert np.isnan(got[T:]).all()
