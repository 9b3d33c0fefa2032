"""Paged decode attention on the GPU against a numpy float64 reference kept here.

Fresh random q/K/V each run; the sequence's pages are scattered at random through a pool larger than the
sequence; every slot the kernel must not read (other pages, other layer, the tail page's slots past
seq_len) holds NaN, so reading one shows up as NaN in the output; out and workspace are NaN before launch.

Tolerance (fp16 output of an fp32 computation): |out - ref| <= 2e-4 + 4e-3 |ref|. fp16 rounding alone
is 2^-11 |ref| ~ 4.9e-4 |ref|; the rest is fp32 accumulation over up to 32768 positions and exp2f.
The tensor-core bodies ("mma", "mma8") round p to fp16 before P.V (as FlashAttention does): at most
2^-11 sum_t p_t |v_t| (p normalised) more, added with a 25% margin for them. (GPU run 2 passed every
variant at the first tolerance; the term keeps the test honest about what the design guarantees.)
"""

import numpy as np
import pytest
from nanoqwen_kernels import KernelError, gpu_status
from nanoqwen_kernels.dims import QWEN25_7B, TINY

OK, REASON = gpu_status()
gpu = pytest.mark.skipif(not OK, reason=REASON)
DIMS = {"7b": QWEN25_7B, "tiny": TINY}


VARIANTS = ["fma", "mma", "mma8"]  # consumer bodies (nanoqwen_kernels.attention.VARIANTS)


@pytest.fixture(scope="module")
def kernels():
    from nanoqwen_kernels.attention import AttentionKernels
    from nanoqwen_kernels.loader import load_module

    return {(name, v): AttentionKernels(d, load_module, v) for name, d in DIMS.items() for v in VARIANTS}


P_ROUNDING = 1.25 * 2.0**-11  # fp16 rounding of p in [0, 1] (relative), with a margin


def reference(q, k_seq, v_seq, n_kv):
    """q [nh,128], k_seq/v_seq [L, n_kv, 128] -> (out [nh,128], P.|V| [nh,128]), all float64."""
    nh = q.shape[0]
    g = nh // n_kv
    out = np.empty((nh, 128))
    pv_abs = np.empty((nh, 128))
    for h in range(nh):
        s = k_seq[:, h // g, :] @ q[h] / np.sqrt(128.0)
        p = np.exp(s - s.max())
        p /= p.sum()
        out[h] = p @ v_seq[:, h // g, :]
        pv_abs[h] = p @ np.abs(v_seq[:, h // g, :])
    return out, pv_abs


def tolerance(ref, pv_abs, variant):
    tol = 2e-4 + 4e-3 * np.abs(ref)
    return tol + P_ROUNDING * pv_abs if variant.startswith("mma") else tol


def make_case(cp, dims, seq_len, rng, n_layers=2, layer=1, spare_pages=7):
    """A pool with the sequence's pages scattered; everything the kernel must not read is NaN."""
    n_seq_pages = (seq_len + 15) // 16
    n_pages = n_seq_pages + spare_pages
    shape = (n_layers, n_pages, dims.n_kv_heads, 16, 128)
    k = np.full(shape, np.nan, dtype=np.float16)
    v = np.full(shape, np.nan, dtype=np.float16)
    table = rng.permutation(n_pages)[:n_seq_pages].astype(np.int32)
    k_seq = rng.standard_normal((seq_len, dims.n_kv_heads, 128))
    v_seq = rng.standard_normal((seq_len, dims.n_kv_heads, 128))
    for t in range(0, seq_len, 16):
        n = min(16, seq_len - t)
        # [16, n_kv, 128] token-major -> the page's [n_kv, 16, 128]
        k[layer, table[t // 16], :, :n] = k_seq[t : t + n].transpose(1, 0, 2)
        v[layer, table[t // 16], :, :n] = v_seq[t : t + n].transpose(1, 0, 2)
    # the kernel sees fp16 K/V: the reference uses the same rounded values
    k_seq = k_seq.astype(np.float16).astype(np.float64)
    v_seq = v_seq.astype(np.float16).astype(np.float64)
    # a page table longer than the sequence: its unused tail points at pages the kernel must not read
    table_dev = np.concatenate([table, rng.integers(0, n_pages, 5).astype(np.int32)])
    q = (2.0 * rng.standard_normal(dims.n_heads * 128)).astype(np.float16)
    ref, pv_abs = reference(q.astype(np.float64).reshape(dims.n_heads, 128), k_seq, v_seq, dims.n_kv_heads)
    return dict(
        q=cp.asarray(q),
        k=cp.asarray(k),
        v=cp.asarray(v),
        table=cp.asarray(table_dev),
        seq=cp.asarray(np.array([seq_len], np.int32)),
        layer=layer,
        ref=ref,
        pv_abs=pv_abs,
    )


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", ["7b", "tiny"])
@pytest.mark.parametrize("seq_len", [1, 15, 16, 17, 4095, 32768])
def test_decode_matches_reference(kernels, name, seq_len, variant):
    import cupy as cp

    dims, ak = DIMS[name], kernels[name, variant]
    rng = np.random.default_rng()
    c = make_case(cp, dims, seq_len, rng)
    out = cp.full(dims.n_heads * 128, np.nan, dtype=cp.float16)
    ws = ak.new_workspace()
    ws.fill(np.nan)
    ak.attention_decode(c["q"], c["k"], c["v"], c["table"], c["seq"], c["layer"], out, ws)
    got = cp.asnumpy(out).astype(np.float64).reshape(dims.n_heads, 128)
    assert np.isfinite(got).all(), "NaN/inf in the output: a masked or foreign slot was read"
    err = np.abs(got - c["ref"])
    tol = tolerance(c["ref"], c["pv_abs"], variant)
    assert (err <= tol).all(), f"max err {err.max():.3g} (worst excess {(err - tol).max():.3g})"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_reads_seq_len_on_device(kernels, variant):
    """The page table covers 40 positions, seq_len_dev says 33: the result follows the device value."""
    import cupy as cp

    dims, ak = TINY, kernels["tiny", variant]
    rng = np.random.default_rng()
    c = make_case(cp, dims, 40, rng)
    out = cp.full(dims.n_heads * 128, np.nan, dtype=cp.float16)
    ws = ak.new_workspace()
    c["seq"][0] = 33  # the page table covers 40; only the first 33 positions count now
    ak.attention_decode(c["q"], c["k"], c["v"], c["table"], c["seq"], c["layer"], out, ws)
    k_all = cp.asnumpy(c["k"])[c["layer"]]
    v_all = cp.asnumpy(c["v"])[c["layer"]]
    table = cp.asnumpy(c["table"])
    k_seq = np.stack([k_all[table[t // 16], :, t % 16] for t in range(33)]).astype(np.float64)
    v_seq = np.stack([v_all[table[t // 16], :, t % 16] for t in range(33)]).astype(np.float64)
    q = cp.asnumpy(c["q"]).astype(np.float64).reshape(dims.n_heads, 128)
    ref, pv_abs = reference(q, k_seq, v_seq, dims.n_kv_heads)
    got = cp.asnumpy(out).astype(np.float64).reshape(dims.n_heads, 128)
    assert (np.abs(got - ref) <= tolerance(ref, pv_abs, variant)).all()


@gpu
@pytest.mark.gpu
def test_decode_rejects_bad_arguments(kernels):
    import cupy as cp

    dims, ak = TINY, kernels["tiny", "fma"]
    c = make_case(cp, dims, 20, np.random.default_rng())
    out = cp.empty(dims.n_heads * 128, dtype=cp.float16)
    ws = ak.new_workspace()
    args = dict(
        q=c["q"],
        k_cache=c["k"],
        v_cache=c["v"],
        page_table=c["table"],
        seq_len_dev=c["seq"],
        layer=c["layer"],
        out=out,
        workspace=ws,
    )
    bad = {
        "q": c["q"].astype(cp.float32),
        "k_cache": c["k"][:, :, :, :8],
        "v_cache": c["v"][:1],
        "page_table": c["table"].astype(cp.int64),
        "seq_len_dev": cp.empty(0, dtype=cp.int32),
        "layer": 2,
        "out": cp.empty(dims.n_heads * 128 + 1, dtype=cp.float16),
        "workspace": ws[:-1],
    }
    for name, value in bad.items():
        with pytest.raises(KernelError, match=name):
            ak.attention_decode(**{**args, name: value})
