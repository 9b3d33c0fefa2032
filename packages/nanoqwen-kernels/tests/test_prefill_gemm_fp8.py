"""The FP8 prefill GEMM (prefill_fp8.py, cuda/gemm_fp8_prefill.cu, cuda/prefill_quant.cu).

CPU: the numpy e4m3 twins (every byte value round-trips; rounding ties to even and saturates), the kernel's
nibble table read out of its source, the SiLU row map, the plan. GPU: the quantizer and the weight
conversion bit for bit against the twins, the GEMM against float64 sums of the same e4m3 operands (so the
only difference is fp32 accumulation order and the one fp16 rounding of the output) at awkward T, every tile
width, split-K, accumulate and the SiLU build, and the whole path's error against the unrounded fp16 GEMM.
"""

import re

import numpy as np
import pytest
from nanoqwen_kernels import gpu_status
from nanoqwen_kernels import prefill_fp8 as f8
from nanoqwen_kernels import prefill_gemm as pg
from nanoqwen_kernels.dims import QWEN25_7B, TINY
from nanoqwen_kernels.loader import CUDA_DIR
from refs import dequant, pack_valueshuffle, random_int4

OK, REASON = gpu_status()
gpu = pytest.mark.skipif(not OK, reason=REASON)

ALL_BYTES = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint8)  # 0x7F / 0xFF are NaN


def test_every_e4m3_byte_round_trips():
    v = f8.e4m3_to_f32(ALL_BYTES)
    assert np.array_equal(f8.round_e4m3(v), v)
    back = f8.e4m3_bytes(v)
    same = back == ALL_BYTES
    # +0 and -0 are the only two bytes of one value; the sign survives
    assert same.all(), ALL_BYTES[~same]
    assert v.max() == 448 and v.min() == -448 and np.sort(np.abs(v))[2] == 2.0**-9


def test_round_e4m3_ties_to_even_and_saturates(rng):
    v = np.sort(np.unique(f8.e4m3_to_f32(ALL_BYTES[ALL_BYTES < 0x80])))  # 0 .. 448
    mid = (v[:-1] + v[1:]) / 2
    r = f8.round_e4m3(mid)
    even = np.where((f8.e4m3_bytes(v[:-1]) & 1) == 0, v[:-1], v[1:])
    assert np.array_equal(r, even)
    assert np.array_equal(f8.round_e4m3(np.array([500.0, -1e6, 449.0], np.float32)), [448, -448, 448])
    x = rng.standard_normal(10000).astype(np.float32) * 50
    r = f8.round_e4m3(x)
    # nearest: no representable value is closer
    idx = np.searchsorted(v, np.abs(x).clip(0, 448))
    lo, hi = v[np.clip(idx - 1, 0, len(v) - 1)], v[np.clip(idx, 0, len(v) - 1)]
    best = np.minimum(np.abs(np.abs(x).clip(0, 448) - lo), np.abs(np.abs(x).clip(0, 448) - hi))
    assert np.allclose(np.abs(np.abs(r) - np.abs(x).clip(0, 448)), best)


def test_kernel_nibble_table_is_e4m3_of_u_minus_8():
    """The conversion kernel's two 64-bit constants hold byte u of e4m3(u - 8) (u < 8 in kLo, the rest kHi)."""
    src = (CUDA_DIR / "prefill_quant.cu").read_text()
    lo, hi = (int(v, 16) for v in re.search(r"kLo = 0x([0-9A-Fa-f]+)ull, kHi = 0x([0-9A-Fa-f]+)ull", src).groups())
    lut = np.array([(lo >> 8 * u) & 0xFF for u in range(8)] + [(hi >> 8 * u) & 0xFF for u in range(8)], np.uint8)
    assert np.array_equal(lut, f8.E4M3_OF_U)
    assert np.array_equal(f8.e4m3_to_f32(lut), np.arange(16) - 8)


def test_silu_rowmap_pairs_gate_and_up_rows():
    i = 192
    m = f8.silu_rowmap(2 * i)
    assert np.array_equal(np.sort(m), np.arange(2 * i))
    for y in range(2 * i // 128):
        tile = m[128 * y : 128 * y + 128]
        for r in range(0, 128, 16):  # fragment rows g and g + 8 of a lane: gate and up of one output
            assert np.array_equal(tile[r + 8 : r + 16], tile[r : r + 8] + i)
            assert (tile[r : r + 8] < i).all()
        assert np.array_equal(np.sort(tile[tile < i]), 64 * y + np.arange(64))
    with pytest.raises(Exception, match="2I % 128"):
        f8.silu_rowmap(200)


def test_quantize_rows_np_bounds_the_rounding(rng):
    x = (rng.standard_normal((5, 384)) * np.exp(rng.uniform(-4, 4, (5, 384)))).astype(np.float16)
    x[2] = 0
    xq, sx = f8.quantize_rows_np(x)
    assert sx.shape == (5,) and sx[2] == 1.0 and not xq[2].any()
    back = f8.e4m3_to_f32(xq) * sx[:, None]
    xf = x.astype(np.float32)
    amax = np.abs(xf).max(axis=1, keepdims=True)
    err = np.abs(back - xf)
    # relative 2^-4 in the normal range, absolute half a subnormal step below it
    assert (err <= np.maximum(np.abs(xf) / 16, amax / 448 * 2.0**-10) * 1.0001).all()
    # the row's amax maps to 448 (back to amax but for the float32 rounding of amax / 448 and of 448 s)
    assert np.allclose(np.abs(back).max(axis=1), amax[:, 0], rtol=1e-6, atol=0)


def test_fp8_plan_and_smem():
    for t, n, k in [(1, 4608, 3584), (512, 37888, 3584), (512, 3584, 18944), (8192, 3584, 3584), (17, 256, 256)]:
        bn, s = pg.choose_plan_fp8(t, n, k, 132)
        assert bn in pg.GF8_WIDTHS and 1 <= s <= k // 128
        assert pg.choose_plan_fp8(t, n, k, 132, split_ok=False)[1] == 1
    src = (CUDA_DIR / "gemm_fp8_prefill.cu").read_text()
    assert "kMaxStages = 6;" in src and pg.GF8_MAX_STAGES == 6
    # the ring beside the epilogue's staging: n128 4 plain / 5 SiLU stages, n64 6
    assert [pg.fp8_stages(bn, silu) for bn in (128, 64) for silu in (False, True)] == [4, 5, 6, 6]
    for bn in pg.GF8_WIDTHS:
        for silu in (False, True):
            assert pg.fp8_smem_bytes(bn, silu) <= pg.GF8_SMEM_MAX
    # persistent: at most a block per SM, never more blocks than tiles
    assert pg.fp8_grid(8192, 37888, 128, 1, 132) == (132, 1, 1)
    assert pg.fp8_grid(17, 256, 64, 1, 132) == (2, 1, 1) and pg.fp8_units(512, 3584, 128, 3) == 4 * 28 * 3
    assert pg.fp8_stage_bytes(128) == 33 * 1024 and pg.fp8_stage_bytes(64) == 25 * 1024  # 32.5 / 24.5 KB, rounded up


def test_fp8_smem_mirror_matches_the_kernel():
    """prefill_gemm.fp8_smem_bytes (what a launch asks for) equals the kernel's gf8::smem_bytes for every
    width and build: the kernel's static_assert on the mirror's numbers compiles; off by 1 KB it does not."""
    from nanoqwen_kernels.errors import KernelError
    from nanoqwen_kernels.loader import compile_cubin

    def mirror(delta: int = 0) -> dict:
        return {"NQ_GF8_MIRROR_N128": pg.fp8_smem_bytes(128, False) + delta,
                "NQ_GF8_MIRROR_N128_SILU": pg.fp8_smem_bytes(128, True),
                "NQ_GF8_MIRROR_N64": pg.fp8_smem_bytes(64, False),
                "NQ_GF8_MIRROR_N64_SILU": pg.fp8_smem_bytes(64, True)}

    assert compile_cubin(["gemm_fp8_prefill.cu"], {**TINY.defines(), **mirror()})[:4] == b"\x7fELF"
    with pytest.raises(KernelError, match="fp8_smem_bytes disagrees"):
        compile_cubin(["gemm_fp8_prefill.cu"], {**TINY.defines(), **mirror(1024)})


# ---- GPU ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernels():
    from nanoqwen_kernels.loader import load_module
    from nanoqwen_kernels.prefill import PrefillKernels

    return {"7b": PrefillKernels(QWEN25_7B, load_module).fp8, "tiny": PrefillKernels(TINY, load_module).fp8}


def activations(rng, t, k):
    """fp16 rows with a spread of magnitudes and an outlier channel (as real activations have)."""
    x = rng.standard_normal((t, k)) * np.exp(rng.uniform(-2, 2, (1, k)))
    x[:, rng.integers(k)] *= 40
    return x.astype(np.float16)


def quantized(kern, x):
    import cupy as cp

    t, k = x.shape
    xq = cp.full((t, k), 0x7F, dtype=cp.uint8)  # NaN bytes: any byte left unwritten shows
    sx = cp.full(t, np.nan, dtype=cp.float32)
    kern.quantize_e4m3(cp.asarray(x), xq, sx)
    return xq, sx


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("t,k", [(1, 3584), (17, 256), (513, 3584), (40, 18944)])
def test_quantize_matches_numpy_bit_for_bit(kernels, rng, t, k):
    import cupy as cp

    x = activations(rng, t, k)
    if t > 3:
        x[3] = 0  # an all-zero row: scale 1, bytes 0
    xq, sx = quantized(kernels["7b"], x)
    ref_q, ref_s = f8.quantize_rows_np(x)
    got_s = cp.asnumpy(sx)
    assert np.array_equal(got_s.view(np.uint32), ref_s.view(np.uint32))
    got_q = cp.asnumpy(xq)
    assert np.array_equal(got_q, ref_q), f"{np.count_nonzero(got_q != ref_q)} of {got_q.size} bytes differ"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 17, 300])
def test_rmsnorm_e4m3_is_rmsnorm_then_quantize(kernels, rng, t):
    """The fused norm + quantizer gives the bits of rmsnorm_rows (the norm kernel) then quantize_e4m3."""
    import cupy as cp
    from nanoqwen_kernels.loader import load_module
    from nanoqwen_kernels.norm import NormKernels

    h = QWEN25_7B.hidden
    x = cp.asarray(activations(rng, t, h))
    w = cp.asarray((1 + 0.3 * rng.standard_normal(h)).astype(np.float16))
    normed = cp.full((t, h), np.nan, dtype=cp.float16)
    NormKernels(QWEN25_7B, load_module).rmsnorm_rows(x, w, normed, 1e-6)
    want_q, want_s = quantized(kernels["7b"], cp.asnumpy(normed))
    xq = cp.full((t, h), 0x7F, dtype=cp.uint8)
    sx = cp.full(t, np.nan, dtype=cp.float32)
    kernels["7b"].rmsnorm_e4m3(x, w, xq, sx, 1e-6)
    assert np.array_equal(cp.asnumpy(sx).view(np.uint32), cp.asnumpy(want_s).view(np.uint32))
    assert np.array_equal(cp.asnumpy(xq), cp.asnumpy(want_q))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("silu", [False, True])
def test_int4_to_e4m3_matches_numpy(kernels, rng, silu):
    import cupy as cp

    n, k = 384, 512
    u, s = random_int4(rng, n, k, scale=0.1)
    rowmap = f8.silu_rowmap(n) if silu else None
    w8, sw = kernels["7b"].int4_to_e4m3(cp.asarray(pack_valueshuffle(u)), cp.asarray(s), rowmap)
    rows = np.arange(n) if rowmap is None else rowmap
    assert np.array_equal(cp.asnumpy(w8), f8.E4M3_OF_U[u[rows]])
    assert np.array_equal(cp.asnumpy(sw)[:, :n], s[rows].astype(np.float32).T)
    assert sw.shape == (k // 128, f8.n_pad(n))


def _gemm_case(kern, rng, t, n, k, tile=None, splits=None, accumulate=False):
    import cupy as cp

    u, s = random_int4(rng, n, k, scale=0.1)
    w8, sw = kern.int4_to_e4m3(cp.asarray(pack_valueshuffle(u)), cp.asarray(s))
    x = activations(rng, t, k)
    xq, sx = quantized(kern, x)
    res = (4 * rng.standard_normal((t, n))).astype(np.float16)
    out = cp.asarray(res) if accumulate else cp.full((t, n), np.nan, dtype=cp.float16)
    ws = cp.full((splits or 1) * t * n, np.nan, dtype=cp.float32) if splits and splits > 1 else None
    kern.gemm_fp8(w8, sw, xq, sx, out, accumulate=accumulate, tile=tile, splits=splits, workspace=ws)
    ref = f8.gemm_fp8_np(cp.asnumpy(w8), cp.asnumpy(sw), cp.asnumpy(xq), cp.asnumpy(sx))
    if accumulate:
        ref = ref + res.astype(np.float64)
    return cp.asnumpy(out).astype(np.float64), ref, (x, u, s)


def _close(got, ref):
    """Hopper's FP8 tensor cores keep fewer bits than fp32 while they sum inside one wgmma chain (the reason
    the kernel promotes every 128 k; DeepSeek-V3's report measures the same), so the bound is looser than
    the fp16 GEMMs': max error <= 2e-3 |ref| + 1e-2 rms(ref), rms error <= 2e-3 rms(ref). A wrong layout,
    scale or tile gives errors of the order of rms(ref) itself."""
    rms = np.sqrt(np.mean(ref**2))
    err = np.abs(got - ref)
    assert np.isfinite(got).all()
    assert np.sqrt(np.mean(err**2)) <= 2e-3 * rms, f"rms err {np.sqrt(np.mean(err**2)) / rms:.3g} of rms(ref)"
    assert (err <= 2e-3 * np.abs(ref) + 1e-2 * rms).all(), f"max err {err.max() / rms:.3g} of rms(ref)"
    print(f"err max {err.max() / rms:.2e} rms {np.sqrt(np.mean(err**2)) / rms:.2e} of rms(ref)")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 17, 511, 513])
@pytest.mark.parametrize("name,n,k", [("7b", 4608, 3584), ("7b", 3584, 18944), ("tiny", 1024, 256), ("tiny", 200, 384)])
def test_gemm_fp8_matches_float64(kernels, rng, t, name, n, k):
    got, ref, _ = _gemm_case(kernels[name], rng, t, n, k)
    _close(got, ref)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tile", pg.GF8_WIDTHS)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_fp8_tiles_splits_accumulate(kernels, rng, tile, splits, accumulate):
    got, ref, _ = _gemm_case(kernels["7b"], rng, 300, 512, 1152, tile=tile, splits=splits, accumulate=accumulate)
    _close(got, ref)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("band", [1, 3, 8])
@pytest.mark.parametrize("tile,splits,accumulate", [(128, 1, False), (64, 3, True), (128, 2, True)])
def test_gemm_fp8_persistent_blocks_walk_many_tiles(kernels, rng, monkeypatch, band, tile, splits, accumulate):
    """Five blocks for 30-110 tiles: each block's ring runs on from one tile into the next (the producer
    filling the next tile's stages during this one's epilogue), in the banded order, with a last band
    narrower than the others (10 row blocks in bands of 3)."""
    from nanoqwen_kernels import checks

    monkeypatch.setattr(checks, "sm_count", lambda device_id=None: 5)
    monkeypatch.setattr(pg, "GF8_BAND", band)
    got, ref, _ = _gemm_case(kernels["7b"], rng, 333, 1280, 768, tile=tile, splits=splits, accumulate=accumulate)
    _close(got, ref)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 130, 700])
@pytest.mark.parametrize("tile", pg.GF8_WIDTHS)
def test_gemm_fp8_silu(kernels, rng, monkeypatch, t, tile):
    """(At 700 tokens on 3 blocks, each block runs several tiles.)"""
    import cupy as cp
    from nanoqwen_kernels import checks

    if t == 700:
        monkeypatch.setattr(checks, "sm_count", lambda device_id=None: 3)

    kern, i, k = kernels["7b"], 320, 512
    u, s = random_int4(rng, 2 * i, k, scale=0.1)
    w8, sw = kern.int4_to_e4m3(cp.asarray(pack_valueshuffle(u)), cp.asarray(s), f8.silu_rowmap(2 * i))
    xq, sx = quantized(kern, activations(rng, t, k))
    out = cp.full((t, i), np.nan, dtype=cp.float16)
    kern.gemm_fp8_silu(w8, sw, xq, sx, out, tile=tile)
    # the reference from the unpermuted copy: gate rows 0 .. I - 1, up rows I .. 2I - 1
    w8p, swp = kern.int4_to_e4m3(cp.asarray(pack_valueshuffle(u)), cp.asarray(s))
    gu = f8.gemm_fp8_np(cp.asnumpy(w8p), cp.asnumpy(swp), cp.asnumpy(xq), cp.asnumpy(sx))
    g, up = gu[:, :i], gu[:, i:]
    _close(cp.asnumpy(out).astype(np.float64), g / (1 + np.exp(-g)) * up)


@gpu
@pytest.mark.gpu
def test_fp8_path_error_against_the_fp16_gemm(kernels, rng):
    """The whole path (quantize X, FP8 GEMM) against float64 sums of the unrounded fp16 X and the same INT4
    weights: the e4m3 rounding of X is the only new error, a few % of the output's rms at most."""
    got, _, (x, u, s) = _gemm_case(kernels["7b"], rng, 257, 3584, 3584)
    exact = x.astype(np.float64) @ dequant(u, s).astype(np.float64).T
    rel = np.sqrt(np.mean((got - exact) ** 2) / np.mean(exact**2))
    assert 1e-3 < rel < 4e-2, rel
