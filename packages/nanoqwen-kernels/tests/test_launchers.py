"""Launcher argument checks on the CPU: every bad argument is one KernelError naming it, and a good call
reaches the launch with the expected grid and argument list. Device arrays are stood in for by numpy
arrays that expose a device-style pointer (the checks are duck-typed on exactly that)."""


import numpy as np
import pytest
from fakes import Dev, assert_each_refused, dev, fake_cupy
from nanoqwen_kernels import KernelError, checks
from nanoqwen_kernels.dims import QWEN25_7B, TINY
from nanoqwen_kernels.embed import EmbedKernels
from nanoqwen_kernels.gemv import GemvKernels
from nanoqwen_kernels.norm import NormKernels
from nanoqwen_kernels.prefill import ATTENTION_VARIANTS, PrefillKernels
from nanoqwen_kernels.sampling import SamplingKernels, pack_params, pack_rng


class Loaded:
    def get_function(self, name, max_dynamic_smem=0):
        return name


@pytest.fixture
def launches(monkeypatch):
    calls = []
    monkeypatch.setattr(
        checks, "launch", lambda fn, grid, block, args, shared_mem=0: calls.append((fn, grid, args))
    )
    monkeypatch.setattr(
        checks, "even_grid", lambda fn, units, threads, shared_mem=0, copies=1: min(units, 132 * 4 // copies)
    )
    monkeypatch.setattr(checks, "sm_count", lambda device_id=None: 132)
    monkeypatch.setattr(checks, "cupy_module", fake_cupy)
    return calls


def load(sources, defines):
    return Loaded()


def test_gemv_int4_good_call_and_residual_alias(launches):
    d = TINY
    g = GemvKernels(d, load, "mixed")  # at B = 1: K = H on the half2 loop, K = I on tensor cores
    qw, sc = dev((300, d.hidden // 8), np.uint32), dev((300, d.hidden // 128), np.float16)
    x, out = dev((d.hidden,), np.float16), dev((300,), np.float16)
    g.gemv_int4(qw, sc, x, out, residual=out)  # in-place residual is allowed
    fn, grid, args = launches[-1]
    assert fn == "nq_gemv_int4_h" and grid == -(-150 // 8) and int(args[-1]) == 300
    qi, si = dev((7, d.intermediate // 8), np.uint32), dev((7, d.intermediate // 128), np.float16)
    g.gemv_int4(qi, si, dev((d.intermediate,), np.float16), dev((7,), np.float16))
    fn, grid, args = launches[-1]
    assert fn == "nq_gemv_int4_i_mma8" and grid == (1, 1)
    assert [int(a) for a in args[-3:]] == [1, 1, d.intermediate // 128]  # B, columns per pass, K whole


@pytest.mark.parametrize("b, entry, passes", [(2, "mma8", 1), (8, "mma8", 1), (9, "mma32", 1), (64, "mma32", 2)])
def test_gemv_int4_batched_launch(launches, b, entry, passes):
    """The "mixed" variant: B > 1 on gemv_mma's passes."""
    d = TINY
    g = GemvKernels(d, load, "mixed")
    qw, sc = dev((300, d.hidden // 8), np.uint32), dev((300, d.hidden // 128), np.float16)
    res = dev((b, 300), np.float16)
    g.gemv_int4(qw, sc, dev((b, d.hidden), np.float16), res, residual=res)
    fn, grid, args = launches[-1]
    assert fn == f"nq_gemv_int4_h_{entry}" and grid[1] == passes and int(args[-3]) == b
    assert int(args[-2]) * passes >= b


@pytest.mark.parametrize("b, build", [(2, 8), (8, 8), (9, 16), (17, 32), (33, 64), (64, 64)])
def test_default_batched_launch_is_the_tile_gemm(launches, monkeypatch, b, build):
    """The default variant: B > 1 on the smallest tile build that holds B, P blocks of 512 threads from
    plan_tiles (a function of the matrix only), dynamic shared memory for that build."""
    from nanoqwen_kernels.gemv import TILE_THREADS, plan_tiles, tile_smem

    d = QWEN25_7B
    g = GemvKernels(d, load)
    qw, sc = dev((d.hidden, d.intermediate // 8), np.uint32), dev((d.hidden, d.intermediate // 128), np.float16)
    res = dev((b, d.hidden), np.float16)
    got = []
    monkeypatch.setattr(checks, "launch", lambda fn, grid, block, args, shared_mem=0: got.append(
        (fn, grid, block, shared_mem)))
    g.gemv_int4(qw, sc, dev((b, d.intermediate), np.float16), res, residual=res)
    fn, grid, block, smem = got[-1]
    assert fn == f"nq_gemv_int4_i_tile{build}" and block == TILE_THREADS and smem == tile_smem(build)
    assert grid == plan_tiles(d.intermediate, d.hidden // 2, 132).blocks


def test_tile_gemm_takes_at_most_64_columns(launches):
    d = TINY
    g = GemvKernels(d, load)
    qw, sc = dev((64, d.hidden // 8), np.uint32), dev((64, d.hidden // 128), np.float16)
    with pytest.raises(KernelError, match="at most 64 columns"):
        g.gemv_int4(qw, sc, dev((65, d.hidden), np.float16), dev((65, 64), np.float16))
    assert not launches


def test_batched_outputs_must_match_the_batch(launches):
    d = TINY
    g = GemvKernels(d, load)
    qw, sc = dev((64, d.hidden // 8), np.uint32), dev((64, d.hidden // 128), np.float16)
    with pytest.raises(KernelError, match=r"out must have shape \(3, 64\)"):
        g.gemv_int4(qw, sc, dev((3, d.hidden), np.float16), dev((64,), np.float16))
    with pytest.raises(KernelError, match=r"x must be \[B, 256\]"):
        g.gemv_int4(qw, sc, dev((3, 2, d.hidden), np.float16), dev((3, 64), np.float16))
    with pytest.raises(KernelError, match=r"residual must have shape \(3, 64\)"):
        g.gemv_int4(qw, sc, dev((3, d.hidden), np.float16), dev((3, 64), np.float16), residual=dev((64,), np.float16))
    assert not launches


@pytest.mark.parametrize(
    "mutate, word",
    [
        (dict(qweight=lambda d: dev((64, d.hidden // 8), np.int32)), "qweight must be uint32"),
        (dict(qweight=lambda d: dev((64, 40), np.uint32)), "neither hidden"),
        (dict(scales=lambda d: dev((64, 3), np.float16)), "scales must be"),
        (dict(scales=lambda d: dev((64, d.hidden // 128), np.float32)), "scales must be float16"),
        (dict(x=lambda d: dev((d.hidden + 8,), np.float16)), r"x must be \[B, 256\]"),
        (dict(out=lambda d: dev((63,), np.float16)), "out must have shape"),
        (dict(residual=lambda d: dev((64,), np.float32)), "residual must be float16"),
        (dict(norm_w=lambda d: dev((5,), np.float16)), "norm_w must have shape"),
        (dict(eps=lambda d: -1.0), "eps"),
        (dict(x=lambda d: np.zeros(d.hidden, np.float16)), "x must be a CuPy array"),
    ],
)
def test_gemv_int4_rejects(launches, mutate, word):
    d = TINY
    args = dict(
        qweight=dev((64, d.hidden // 8), np.uint32),
        scales=dev((64, d.hidden // 128), np.float16),
        x=dev((d.hidden,), np.float16),
        out=dev((64,), np.float16),
        residual=None,
        norm_w=None,
        eps=1e-6,
    )
    for k, f in mutate.items():
        args[k] = f(d)
    with pytest.raises(KernelError, match=word):
        GemvKernels(d, load).gemv_int4(**args)
    assert not launches


def test_gemv_rejects_non_contiguous_misaligned_and_overlap(launches):
    d = TINY
    g = GemvKernels(d, load)
    qw, sc = dev((64, d.hidden // 8), np.uint32), dev((64, d.hidden // 128), np.float16)
    big = dev((2 * d.hidden,), np.float16)
    strided = Dev(big.a[::2])
    with pytest.raises(KernelError, match="x must be C-contiguous"):
        g.gemv_int4(qw, sc, strided, dev((64,), np.float16))
    shifted = Dev(dev((d.hidden + 8,), np.float16).a[1 : d.hidden + 1])
    with pytest.raises(KernelError, match="x must be 16-byte aligned"):
        g.gemv_int4(qw, sc, shifted, dev((64,), np.float16))
    both = dev((d.hidden,), np.float16)
    q2, s2 = dev((d.hidden, d.hidden // 8), np.uint32), dev((d.hidden, d.hidden // 128), np.float16)
    with pytest.raises(KernelError, match="overlap"):
        g.gemv_int4(q2, s2, both, both)
    assert not launches


def _qkv_args(d, b):
    rows = d.qkv_rows
    lead = (b,) if b > 1 else ()
    return dict(
        qweight=dev((rows, d.hidden // 8), np.uint32),
        scales=dev((rows, d.hidden // 128), np.float16),
        bias=dev((rows,), np.float16),
        x=dev((*lead, d.hidden), np.float16),
        norm_w=dev((d.hidden,), np.float16),
        eps=1e-6,
        pos_dev=dev((b,), np.int32),
        page_table=dev((b, 64), np.int32) if b > 1 else dev((64,), np.int32),
        k_cache=dev((2, 4, d.n_kv_heads, 16, 128), np.float16),
        v_cache=dev((2, 4, d.n_kv_heads, 16, 128), np.float16),
        layer=1,
        q_out=dev((*lead, d.q_dim), np.float16),
    )


def test_qkv_rope_kv_checks(launches):
    d = QWEN25_7B
    g = GemvKernels(d, load)
    rows = d.qkv_rows
    good = _qkv_args(d, 1)
    g.qkv_rope_kv(**good)
    fn, grid, args = launches[-1]
    assert fn == "nq_qkv_rope_kv" and int(args[-3]) == 1 and int(args[-2]) == 4 and int(args[8]) == 64
    bad = [
        (
            dict(qweight=dev((rows - 2, d.hidden // 8), np.uint32), scales=dev((rows - 2, 28), np.float16)),
            "rows",
        ),
        (dict(bias=dev((rows - 1,), np.float16)), "bias"),
        (dict(layer=2), "layer"),
        (dict(layer=True), "layer"),
        (dict(k_cache=dev((2, 4, d.n_kv_heads, 8, 128), np.float16)), "k_cache"),
        (dict(v_cache=dev((2, 5, d.n_kv_heads, 16, 128), np.float16)), "v_cache"),
        (dict(pos_dev=dev((2,), np.int32)), "pos_dev"),
        (dict(page_table=dev((4,), np.int64)), "page_table"),
        (dict(q_out=dev((d.q_dim,), np.float32)), "q_out"),
    ]
    assert_each_refused(g.qkv_rope_kv, good, bad)


def test_qkv_rope_kv_batched_checks(launches):
    d = QWEN25_7B
    g = GemvKernels(d, load)
    good = _qkv_args(d, 5)
    g.qkv_rope_kv(**good)
    (norm, _, nargs), (fn, grid, args) = launches[-2:]
    assert norm == "nq_norm_cols_h" and nargs[1] is good["norm_w"]  # the tile GEMM takes x normalised
    assert fn == "nq_qkv_rope_kv_tile8" and int(args[6]) == 64 and int(args[-3]) == 5
    bad = [
        (dict(pos_dev=dev((1,), np.int32)), r"pos_dev must have shape \(5,\)"),
        (dict(page_table=dev((64,), np.int32)), r"page_table must be int32 \[5, max_pages\]"),
        (dict(page_table=dev((4, 64), np.int32)), "page_table"),
        (dict(q_out=dev((4, d.q_dim), np.float16)), "q_out must have shape"),
    ]
    assert_each_refused(g.qkv_rope_kv, good, bad)


def test_gate_up_and_fp16_checks(launches):
    d = TINY
    g = GemvKernels(d, load, "mixed")
    qw, sc = dev((2 * d.intermediate, d.hidden // 8), np.uint32), dev((2 * d.intermediate, 2), np.float16)
    g.gate_up_silu(
        qw,
        sc,
        dev((d.hidden,), np.float16),
        dev((d.hidden,), np.float16),
        1e-6,
        dev((d.intermediate,), np.float16),
    )
    assert launches[-1][0] == "nq_gate_up_silu_mma8"  # "mixed": gate/up on tensor cores at B = 1
    with pytest.raises(KernelError, match="2 x intermediate"):
        g.gate_up_silu(
            dev((d.intermediate, d.hidden // 8), np.uint32),
            dev((d.intermediate, 2), np.float16),
            dev((d.hidden,), np.float16),
            None,
            1e-6,
            dev((d.intermediate,), np.float16),
        )
    g.gemv_fp16(dev((1001, d.hidden), np.float16), dev((d.hidden,), np.float16), dev((1001,), np.float32))
    assert launches[-1][0] == "nq_gemv_fp16" and int(launches[-1][2][-1]) == 1001
    gm = GemvKernels(d, load, "mixed", "mma")  # the lm_head's gemv_mma body at B > 1
    gm.gemv_fp16(dev((1001, d.hidden), np.float16), dev((3, d.hidden), np.float16), dev((3, 1001), np.float32))
    assert launches[-1][0] == "nq_gemv_fp16_mma8" and int(launches[-1][2][-3]) == 3
    with pytest.raises(KernelError, match="out must be float32"):
        g.gemv_fp16(dev((10, d.hidden), np.float16), dev((d.hidden,), np.float16), dev((10,), np.float16))
    with pytest.raises(KernelError, match="w must be"):
        g.gemv_fp16(
            dev((10, d.hidden + 128), np.float16), dev((d.hidden,), np.float16), dev((10,), np.float32)
        )


def _f32_at(address: int) -> float:
    """The float32 a host pointer (cuBLAS's alpha/beta in host pointer mode) points at."""
    import ctypes

    return ctypes.c_float.from_address(address).value


class FakeCublas:
    """cupy_backends' cuBLAS wrapper as blas.Blas calls it: records setStream and gemmEx."""

    def __init__(self):
        self.calls = []

    def create(self):
        return 77

    def setStream(self, handle, ptr):
        self.calls.append(("setStream", handle, ptr))

    def gemmEx(self, *args):
        self.calls.append(("gemmEx", *args))


def test_lm_head_batch_is_one_cublas_gemm_with_fp32_logits(launches, monkeypatch):
    """The default lm_head body at B > 1: one cublasGemmEx, column-major out^T = W^T' x^T: op(A) = T on
    W (ld K), x as is (ld K), m = N, n = B, k = H, fp16 inputs, fp32 output and compute, beta = 0."""
    from nanoqwen_kernels import blas

    fake = FakeCublas()
    monkeypatch.setattr(blas, "_cublas", lambda: fake)
    d = TINY
    g = GemvKernels(d, load, "tiles")
    w, x, out = dev((1001, d.hidden), np.float16), dev((5, d.hidden), np.float16), dev((5, 1001), np.float32)
    n_launches = len(launches)
    g.gemv_fp16(w, x, out)
    assert len(launches) == n_launches  # no kernel of ours
    (_, h, _), (name, h2, ta, tb, m, n, k, alpha, a, atype, lda, b, btype, ldb, beta, c, ctype, ldc, comp, algo) = \
        fake.calls
    assert name == "gemmEx" and h == h2 == 77
    assert (ta, tb, m, n, k) == (blas.CUBLAS_OP_T, blas.CUBLAS_OP_N, 1001, 5, d.hidden)
    assert (a, lda, b, ldb, c, ldc) == (w.data.ptr, d.hidden, x.data.ptr, d.hidden, out.data.ptr, 1001)
    assert (atype, btype, ctype, comp) == (blas.CUDA_R_16F, blas.CUDA_R_16F, blas.CUDA_R_32F, blas.CUBLAS_COMPUTE_32F)
    assert _f32_at(beta) == 0.0 and _f32_at(alpha) == 1.0
    # B = 1 stays on the fp16 GEMV kernel
    g.gemv_fp16(w, dev((d.hidden,), np.float16), dev((1001,), np.float32))
    assert launches[-1][0] == "nq_gemv_fp16" and len(fake.calls) == 2
    with pytest.raises(KernelError, match="unknown lm_head body"):
        GemvKernels(d, load, "tiles", "cutlass")


def test_prefill_gemm_accumulate_is_cublas_beta_one(launches, monkeypatch):
    """gemm_int4: dequantize into the workspace, then one GEMM into out, fp16 out, beta = 1 when
    accumulating (the residual add folded in), 0 otherwise."""
    from nanoqwen_kernels import blas

    fake = FakeCublas()
    monkeypatch.setattr(blas, "_cublas", lambda: fake)
    p = PrefillKernels(TINY, load)
    qw, sc = dev((8, 256 // 8), np.uint32), dev((8, 2), np.float16)
    X, out, ws = dev((4, 256), np.float16), dev((4, 8), np.float16), dev((8 * 256,), np.float16)

    for acc, beta in ((False, 0.0), (True, 1.0)):
        p.gemm_int4(qw, sc, X, out, ws, accumulate=acc)
        fn, _, args = launches[-1]
        assert fn == "nq_dequantize_int4" and args[2].data.ptr == ws.data.ptr  # W lands in the workspace
        call = fake.calls[-1]
        assert call[0] == "gemmEx" and call[4:7] == (8, 4, 256) and call[16] == blas.CUDA_R_16F
        assert call[8] == ws.data.ptr and call[15] == out.data.ptr and _f32_at(call[14]) == beta
    aliased = X.reshape(-1)[:32].reshape(4, 8)  # out's shape, X's memory
    with pytest.raises(KernelError, match="X and out overlap"):
        p.gemm_int4(qw, sc, X, aliased, ws)


def test_norm_embed_checks(launches):
    d = TINY
    n = NormKernels(d, load)
    x = dev((3, d.hidden), np.float16)
    n.rmsnorm_rows(x, dev((d.hidden,), np.float16), x, 1e-6)  # in place is fine
    assert launches[-1][1] == 3
    n.rmsnorm(x, dev((d.hidden,), np.float16), dev((3, d.hidden), np.float16), 1e-6)  # B rows
    assert launches[-1][1] == 3
    with pytest.raises(KernelError, match="x must be"):
        n.rmsnorm_rows(
            dev((d.hidden,), np.float16), dev((d.hidden,), np.float16), dev((d.hidden,), np.float16), 1e-6
        )
    with pytest.raises(KernelError, match="w must have shape"):
        n.rmsnorm(dev((d.hidden,), np.float16), dev((7,), np.float16), dev((d.hidden,), np.float16), 1e-6)
    e = EmbedKernels(d, load)
    e.embed(dev((d.vocab, d.hidden), np.float16), dev((4,), np.int32), dev((4, d.hidden), np.float16))
    assert launches[-1][1] == (1, 4)
    with pytest.raises(KernelError, match="table must have shape"):
        e.embed(dev((d.vocab - 1, d.hidden), np.float16), dev((1,), np.int32), dev((d.hidden,), np.float16))
    with pytest.raises(KernelError, match="token_dev must be int32"):
        e.embed(dev((d.vocab, d.hidden), np.float16), dev((1,), np.int64), dev((d.hidden,), np.float16))
    with pytest.raises(KernelError, match=r"token_dev must have shape \(4,\)"):
        e.embed(dev((d.vocab, d.hidden), np.float16), dev((1,), np.int32), dev((4, d.hidden), np.float16))


def test_sampling_checks(launches):
    s = SamplingKernels(TINY, load)
    logits, tok = dev((1000,), np.float32), dev((1,), np.int32)
    s.argmax(logits, tok)
    fn, grid, _ = launches[-1]
    assert fn == "nq_argmax" and grid == (128, 1, 1)  # batch 1: 128 blocks on the one row
    s.argmax(dev((64, 1000), np.float32), dev((64,), np.int32))
    assert launches[-1][1] == (8, 64, 1)  # 64 rows: 8 blocks each, 512 in all (the workspace's slots)
    with pytest.raises(KernelError, match="token_out must have shape"):
        s.argmax(dev((3, 1000), np.float32), tok)
    with pytest.raises(KernelError, match="at most 512"):
        s.argmax(dev((513, 8), np.float32), dev((513,), np.int32))
    params, rng = dev((1, 5), np.float32), dev((1, 2), np.uint64)
    s.sample(logits, params, rng, dev((1, 1000), np.uint8), tok)
    assert launches[-1][0] == "nq_sample" and launches[-1][1] == 1
    s.sample(dev((3, 1000), np.float32), dev((3, 5), np.float32), dev((3, 2), np.uint64),
             dev((3, 1000), np.uint8), dev((3,), np.int32))
    assert launches[-1][1] == 3  # one block per row
    with pytest.raises(KernelError, match="history must have shape"):
        s.sample(logits, params, rng, dev((1, 999), np.uint8), tok)
    with pytest.raises(KernelError, match="params must have shape"):
        s.sample(dev((2, 1000), np.float32), params, rng, dev((2, 1000), np.uint8), dev((2,), np.int32))
    with pytest.raises(KernelError, match="logits must be float32"):
        s.argmax(dev((1000,), np.float16), tok)
    with pytest.raises(KernelError, match="rng_state"):
        s.sample(logits, params, dev((1, 2), np.int64), dev((1, 1000), np.uint8), tok)
    for kw, word in [
        (dict(top_p=0.0), "top_p"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=-3), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(temperature=float("nan")), "temperature"),
    ]:
        p = dict(temperature=0.7, top_k=0, top_p=0.9, min_p=0.0, repetition_penalty=1.0)
        p.update(kw)
        with pytest.raises(KernelError, match=word):
            pack_params(**p)
    np.testing.assert_array_equal(
        pack_params(temperature=0.5, top_k=10**9, top_p=0.9, min_p=0.05, repetition_penalty=1.1),
        np.array([0.5, 2**24, 0.9, 0.05, 1.1], np.float32))
    with pytest.raises(KernelError, match="seed"):
        pack_rng(-1)
    assert pack_rng(2**70 + 5, 9).tolist() == [5, 9]  # seeds wrap mod 2^64
    s.advance(dev((1,), np.int32), dev((1,), np.int32))
    assert launches[-1][0] == "nq_advance"
    s.advance(dev((300,), np.int32), dev((300,), np.int32))
    assert launches[-1][1] == 3 and int(launches[-1][2][2]) == 300  # ceil(300 / 128) blocks, rows = 300
    with pytest.raises(KernelError, match="seq_len_dev"):
        s.advance(dev((1,), np.int32), dev((2,), np.int32))


def test_attention_decode_launch_and_checks(launches):
    from nanoqwen_kernels.attention import AttentionKernels, decode_splits

    d = QWEN25_7B
    ak = AttentionKernels(d, load, sms=132)
    W, P, B = d.n_heads * 128, 9, 3
    q, out = dev((B, W), np.float16), dev((B, W), np.float16)
    k, v = dev((2, 40, d.n_kv_heads, 16, 128), np.float16), dev((2, 40, d.n_kv_heads, 16, 128), np.float16)
    table, lens = dev((B, P), np.int32), dev((B,), np.int32)
    ws = dev((ak.workspace_floats(B),), np.float32)
    ak.attention_decode(q, k, v, table, lens, 1, out, ws)
    splits = decode_splits(d, B, 132)
    assert splits == 11  # ceil(132 / (4 KV heads x 3 sequences))
    (fn1, grid1, args1), (fn2, grid2, args2) = launches[-2:]
    assert (fn1, grid1, fn2, grid2) == ("nq_attention_decode_split", (4, splits, B),
                                       "nq_attention_decode_combine", (d.n_heads, B, 1))
    assert args1[-1] is ws and args2[-1] is out and int(args1[-2]) == splits
    # the batch of one: 1-D q, out and table
    ak.attention_decode(dev((W,), np.float16), k, v, dev((P,), np.int32), dev((1,), np.int32), 1,
                        dev((W,), np.float16), ws)
    assert launches[-2][1] == (4, 33, 1)
    bad = dict(
        page_table=(dev((2, P), np.int32), "page_table"),
        seq_len_dev=(dev((2,), np.int32), "seq_len_dev"),
        workspace=(dev((ak.workspace_floats(1) // 2,), np.float32), "workspace"),
        out=(dev((B, W - 1), np.float16), "out"),
        layer=(2, "layer"),
    )
    args = dict(q=q, k_cache=k, v_cache=v, page_table=table, seq_len_dev=lens, layer=1, out=out, workspace=ws)
    for name, (value, word) in bad.items():
        with pytest.raises(KernelError, match=word):
            ak.attention_decode(**{**args, name: value})


def _paged(d, max_pages=4):
    """k/v caches of 2 layers x 4 pages and a page table of max_pages entries: room for 64 positions."""
    shape = (2, 4, d.n_kv_heads, 16, 128)
    return dict(k_cache=dev(shape, np.float16), v_cache=dev(shape, np.float16),
                page_table=dev((max_pages,), np.int32))


def test_prefill_int4_checks(launches):
    p = PrefillKernels(TINY, load)
    qw, sc = dev((8, 256 // 8), np.uint32), dev((8, 2), np.float16)
    p.dequantize_int4(qw, sc, dev((8, 256), np.float16))
    fn, grid, args = launches[-1]
    assert fn == "nq_dequantize_int4" and grid == (1, 1, 1) and [int(a) for a in args[-2:]] == [8, 256]
    good = dict(qweight=qw, scales=sc, X=dev((4, 256), np.float16), out=dev((4, 8), np.float16))
    bad = [
        (dict(qweight=dev((8, 3), np.uint32)), "qweight K = 24 is not a multiple"),
        (dict(qweight=dev((8, 32), np.int32)), "qweight must be uint32"),
        (dict(scales=dev((8, 1), np.float16)), "scales must have shape"),
        (dict(X=dev((4, 128), np.float16)), r"X must be fp16 \[T, 256\]"),
        (dict(out=dev((4, 8), np.float32)), "out must be float16"),
        (dict(workspace=dev((8 * 256 - 1,), np.float16)), "workspace needs at least 2048"),
    ]
    assert_each_refused(p.gemm_int4, good, bad)
    with pytest.raises(KernelError, match=r"out must have shape \(8, 256\)"):
        p.dequantize_int4(qw, sc, dev((8, 255), np.float16))


def test_rope_kv_prefill_checks(launches):
    d = TINY
    p = PrefillKernels(d, load)
    good = dict(qkv=dev((3, d.qkv_rows), np.float16), start_pos=61, layer=1, q_out=dev((3, d.q_dim), np.float16),
                **_paged(d))
    p.rope_kv_prefill(**good)  # positions 61..63: the last slots of 4 pages
    fn, grid, args = launches[-1]
    assert fn == "nq_rope_kv_prefill" and grid == (3, d.n_heads + 2 * d.n_kv_heads, 1)
    assert int(args[1]) == 0  # no bias: a null pointer
    assert [int(args[i]) for i in (2, 6, 7)] == [61, 1, 4]  # start_pos, layer, n_pages
    bias = dev((d.qkv_rows,), np.float16)
    p.rope_kv_prefill(**good, bias=bias)
    assert launches[-1][2][1] is bias
    bad = [
        (dict(bias=dev((d.qkv_rows - 1,), np.float16)), "bias must have shape"),
        (dict(bias=dev((d.qkv_rows,), np.float32)), "bias must be float16"),
        (dict(qkv=dev((3, d.qkv_rows - 128), np.float16)), "qkv must be fp16"),
        (dict(q_out=dev((2, d.q_dim), np.float16)), "q_out must have shape"),
        (dict(start_pos=62), r"start_pos \+ T = 65 exceeds the page table's 64 positions"),
        (dict(start_pos=-1), "start_pos"),
        (dict(layer=-1), "layer"),
        (dict(layer=2), "layer"),
        (dict(page_table=dev((4,), np.float32)), "page_table must be int32"),
        (dict(page_table=dev((2, 4), np.int32)), "page_table must be a non-empty 1-D"),
        (dict(k_cache=dev((2, 4, d.n_kv_heads + 1, 16, 128), np.float16)), "k_cache must be"),
        (dict(v_cache=dev((2, 5, d.n_kv_heads, 16, 128), np.float16)), "v_cache shape"),
    ]
    assert_each_refused(p.rope_kv_prefill, good, bad)


@pytest.mark.parametrize("variant", sorted(ATTENTION_VARIANTS))
def test_attention_prefill_checks(launches, variant):
    d = TINY
    p = PrefillKernels(d, load, variant)
    kernel, rows, threads = ATTENTION_VARIANTS[variant]
    good = dict(q=dev((33, d.q_dim), np.float16), start_pos=0, T=33, layer=0, out=dev((33, d.q_dim), np.float16),
                **_paged(d))
    p.attention_prefill(**good)
    fn, grid, args = launches[-1]
    assert fn == kernel and grid == (-(-33 // rows), d.n_heads, 1)
    bad = [
        (dict(q=dev((33, d.q_dim), np.float32)), "q must be float16"),
        (dict(out=dev((34, d.q_dim), np.float16)), "out must have shape"),
        (dict(T=34), "q has 33 rows but T = 34"),
        (dict(T=0), "T = 0 out of range"),
        (dict(start_pos=32), r"start_pos \+ T = 65 exceeds"),
        (dict(k_cache=dev((2, 4, d.n_kv_heads + 1, 16, 128), np.float16)), "k_cache"),
        (dict(layer=True), "layer must be an int"),
    ]
    assert_each_refused(p.attention_prefill, good, bad)


def test_kernelset_exposes_the_interface(monkeypatch, launches):
    """KernelSet builds every launcher and exposes each name of docs/INTERFACES.md section 4 (plus the
    sampler-state helpers the GPU backend uses)."""
    from nanoqwen_kernels import KernelSet, kernelset

    built = []
    monkeypatch.setattr(
        kernelset, "load_module", lambda sources, defines, arch: built.append(sources) or Loaded()
    )
    ks = KernelSet(TINY, arch="sm_90a")
    names = [
        "rmsnorm",
        "rmsnorm_rows",
        "gemv_int4",
        "qkv_rope_kv",
        "gate_up_silu",
        "attention_decode",
        "gemv_fp16",
        "embed",
        "argmax",
        "sample",
        "advance",
        "gemm_int4",
        "rope_kv_prefill",
        "attention_prefill",
        "dequantize_int4",
        "make_sampler_state",
        "set_sampler_params",
        "attention_workspace",
    ]
    for name in names:
        assert callable(getattr(ks, name)), name
    srcs = {s for group in built for s in group}
    assert {"gemv_int4.cu", "gemv_fp16.cu", "rmsnorm.cu", "embed.cu", "sampling.cu"} <= srcs
    with pytest.raises(KernelError, match="ModelDims"):
        KernelSet({"hidden_size": 256}, arch="sm_90a")


def test_gemv_plan_examples():
    """The 7B's matrices: x of a pass in shared memory whole when it fits; else restaged per tile (few
    tiles) or more passes (many tiles)."""
    from nanoqwen_kernels.gemv import X_SMEM_BUDGET, plan_gemv

    h, i = QWEN25_7B.hidden, QWEN25_7B.intermediate
    p = plan_gemv(1, i, 224, 132)  # down_proj at B = 1: 38 KB of x, staged once
    assert (p.build, p.passes, p.pass_cols, p.slice_groups) == (8, 1, 1, i // 128)
    p = plan_gemv(32, i, 224, 132)  # down_proj at B = 32: one pass, K in slices of a multiple of 8 groups
    assert (p.build, p.passes, p.pass_cols) == (32, 1, 32) and p.slice_groups % 8 == 0
    assert p.smem <= X_SMEM_BUDGET
    p = plan_gemv(32, h, 2368, 132)  # gate/up at B = 32: two passes of 16 columns, K whole
    assert (p.build, p.passes, p.pass_cols, p.slice_groups) == (32, 2, 16, h // 128)
    p = plan_gemv(64, h, 2368, 132)
    assert (p.passes, p.pass_cols, p.slice_groups) == (3, 22, h // 128)
    p = plan_gemv(8, h, 224, 132)
    assert (p.build, p.passes, p.pass_cols, p.slice_groups) == (8, 1, 8, h // 128)


@pytest.mark.parametrize("k", [256, 1536, 3584, 8960, 18944])
@pytest.mark.parametrize("tiles", [1, 224, 2368, 9504])
def test_gemv_plan_invariants(k, tiles):
    from nanoqwen_kernels.gemv import MMA_BUILDS, X_SMEM_BUDGET, plan_gemv

    for b in range(1, 65):
        p = plan_gemv(b, k, tiles, 132)
        assert p.build in MMA_BUILDS and p.pass_cols <= p.build
        assert p.passes * p.pass_cols >= b > (p.passes - 1) * p.pass_cols  # every pass has columns
        assert p.smem <= X_SMEM_BUDGET
        assert p.slice_groups == k // 128 or p.slice_groups % 8 == 0  # sliced: the same sums' order


def test_cublas_status_is_a_kernel_error():
    """blas._CublasLib (ctypes, not CuPy's wrapper, which refuses calls during a graph capture): a
    non-zero cublasStatus_t is one KernelError naming the call; handles and streams pass through."""
    from nanoqwen_kernels.blas import _CublasLib

    seen = []

    class Lib:
        def __init__(self, gemm_status):
            self.cublasCreate_v2 = _Fn(lambda h: 0)
            self.cublasSetStream_v2 = _Fn(lambda h, s: seen.append((h, s)) or 0)
            self.cublasGemmEx = _Fn(lambda *a: gemm_status)

    lib = _CublasLib(Lib(0))
    lib.setStream(5, 9)
    assert seen[-1] == (5, 9)
    lib.gemmEx(*range(19))
    with pytest.raises(KernelError, match="cuBLAS GemmEx failed with status 13"):
        _CublasLib(Lib(13)).gemmEx(*range(19))


class _Fn:
    """A ctypes function stand-in: settable argtypes/restype, callable."""

    def __init__(self, f):
        self.f, self.argtypes, self.restype = f, None, None

    def __call__(self, *args):
        return self.f(*args)
