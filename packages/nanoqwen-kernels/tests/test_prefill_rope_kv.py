"""rope_kv_prefill on the GPU against numpy's RoPE (refs.rope: the angles as HF and the decode path compute
them, rotated in float64); K/V land in the right page slots only.

The caches start all-NaN: after the launch exactly the (page, slot) pairs of positions
start_pos .. start_pos+T-1 of the chosen layer hold numbers, everything else is still NaN.
Tolerance: q/k |out - ref| <= 2e-3 + 2e-3 |ref| (fp16 output; sincosf's error);
v is a copy, checked bit-exact.
"""

import numpy as np
import pytest
from nanoqwen_kernels import gpu_status
from nanoqwen_kernels.dims import QWEN25_7B, TINY
from refs import rope, scattered_pages

OK, REASON = gpu_status()
gpu = pytest.mark.skipif(not OK, reason=REASON)
DIMS = {"7b": QWEN25_7B, "tiny": TINY}
BODIES = ["vec", "scalar"]  # prefill.py's rope bodies: 4 pairs per thread (the default), 1 pair per thread


@pytest.fixture(scope="module")
def kernels():
    from nanoqwen_kernels.loader import load_module
    from nanoqwen_kernels.prefill import PrefillKernels

    out = {}
    for name, d in DIMS.items():
        for body in BODIES:
            pk = PrefillKernels(d, load_module)
            pk.rope_body = body  # the launcher's body ($NANOQWEN_ROPE_PREFILL's default is "vec")
            out[name, body] = pk
        out[name] = out[name, "vec"]
    return out


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["7b", "tiny"])
@pytest.mark.parametrize("start_pos", [0, 37])
@pytest.mark.parametrize("T", [1, 15, 16, 17, 100, 513])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("body", BODIES)
def test_rope_kv_prefill(kernels, rng, name, start_pos, T, with_bias, body):
    """with_bias: the projection's bias is added in the kernel (fp32, before RoPE and the K/V write)."""
    import cupy as cp

    d = DIMS[name]
    table, n_pages = scattered_pages(rng, start_pos + T)
    shape = (2, n_pages, d.n_kv_heads, 16, 128)
    k_cache = cp.full(shape, np.nan, dtype=cp.float16)
    v_cache = cp.full(shape, np.nan, dtype=cp.float16)
    qkv = rng.standard_normal((T, d.qkv_rows)).astype(np.float16)
    q_out = cp.full((T, d.q_dim), np.nan, dtype=cp.float16)
    layer = 1
    bias = rng.standard_normal(d.qkv_rows).astype(np.float16) if with_bias else None
    kernels[name, body].rope_kv_prefill(
        cp.asarray(qkv), start_pos, cp.asarray(table), k_cache, v_cache, layer, q_out,
        bias=None if bias is None else cp.asarray(bias),
    )

    pos = np.arange(start_pos, start_pos + T)
    x = qkv.astype(np.float64) + (0.0 if bias is None else bias.astype(np.float64))
    nh, nkv = d.n_heads, d.n_kv_heads
    q_ref = rope(x[:, : nh * 128].reshape(T, nh, 128), pos, d.rope_theta).reshape(T, -1)
    k_ref = rope(x[:, nh * 128 : (nh + nkv) * 128].reshape(T, nkv, 128), pos, d.rope_theta)
    # V is x rounded once to fp16 (the sum is exact in fp32: two fp16 values of similar magnitude)
    v_ref = x[:, (nh + nkv) * 128 :].astype(np.float16).reshape(T, nkv, 128)

    got_q = cp.asnumpy(q_out).astype(np.float64)
    assert (np.abs(got_q - q_ref) <= 2e-3 + 2e-3 * np.abs(q_ref)).all()
    kc, vc = cp.asnumpy(k_cache), cp.asnumpy(v_cache)
    pages, slots = table[pos // 16], pos % 16
    got_k = kc[layer, pages, :, slots].astype(np.float64)  # [T, nkv, 128]
    got_v = vc[layer, pages, :, slots]
    assert (np.abs(got_k - k_ref) <= 2e-3 + 2e-3 * np.abs(k_ref)).all()
    assert np.array_equal(got_v.view(np.uint16), v_ref.view(np.uint16))
    written = T * nkv * 128
    assert np.count_nonzero(~np.isnan(kc)) == written, "K written outside its slots"
    assert np.count_nonzero(~np.isnan(vc)) == written, "V written outside its slots"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("start_pos", "T", "bucket"), [(0, 1, 16), (37, 17, 32), (5, 64, 64)])
def test_rope_kv_prefill_from_device_ctl(kernels, rng, start_pos, T, bucket):
    """ctl = (start_pos, T) on the device, the launch over a bucket of rows (a captured prefill graph's
    form): the real rows give what the host-scalar launch gives, bit for bit; the padding rows write no
    K/V even though their positions run past the table's pages (-1 entries, or past its end)."""
    import cupy as cp

    d = DIMS["tiny"]
    table, n_pages = scattered_pages(rng, start_pos + T)
    table_dev = cp.asarray(table)  # covers exactly the real positions' pages
    qkv = cp.asarray(rng.standard_normal((bucket, d.qkv_rows)).astype(np.float16))
    outs = []
    for ctl in (None, cp.asarray(np.array([start_pos, T], dtype=np.int32))):
        shape = (2, n_pages, d.n_kv_heads, 16, 128)
        k_cache = cp.full(shape, np.nan, dtype=cp.float16)
        v_cache = cp.full(shape, np.nan, dtype=cp.float16)
        rows = T if ctl is None else bucket
        q_out = cp.full((rows, d.q_dim), np.nan, dtype=cp.float16)
        kernels["tiny"].rope_kv_prefill(qkv[:rows], start_pos if ctl is None else None, table_dev, k_cache,
                                        v_cache, 1, q_out, ctl=ctl)
        outs.append((cp.asnumpy(q_out[:T]), cp.asnumpy(k_cache), cp.asnumpy(v_cache)))
    for a, b in zip(outs[0], outs[1], strict=True):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("start_pos", "T"), [(0, 513), (32000, 77)])
def test_rope_kv_prefill_bodies_agree_bit_for_bit(kernels, rng, start_pos, T):
    """The vec body performs the scalar body's fp32 operations on each pair: q, K and V identical, bit for
    bit, with a bias, at positions up to 32k (where an ulp of angle shows)."""
    import cupy as cp

    d = DIMS["7b"]
    table, n_pages = scattered_pages(rng, start_pos + T)
    qkv = cp.asarray(rng.standard_normal((T, d.qkv_rows)).astype(np.float16))
    bias = cp.asarray(rng.standard_normal(d.qkv_rows).astype(np.float16))
    outs = []
    for body in BODIES:
        shape = (1, n_pages, d.n_kv_heads, 16, 128)
        k_cache = cp.full(shape, np.nan, dtype=cp.float16)
        v_cache = cp.full(shape, np.nan, dtype=cp.float16)
        q_out = cp.full((T, d.q_dim), np.nan, dtype=cp.float16)
        kernels["7b", body].rope_kv_prefill(qkv, start_pos, cp.asarray(table), k_cache, v_cache, 0, q_out,
                                            bias=bias)
        outs.append([cp.asnumpy(a).view(np.uint16) for a in (q_out, k_cache, v_cache)])
    for a, b in zip(*outs, strict=True):
        assert np.array_equal(a, b)
