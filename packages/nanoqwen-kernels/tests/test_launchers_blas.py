"""The cuBLAS launches (blas.py) on the CPU: the batched lm_head and the prefill GEMM reach cublasGemmEx with
the column-major arguments, types and alpha/beta they must; a failed cuBLAS call is one KernelError."""

import numpy as np
import pytest
from fakes import assert_each_refused, dev, load
from nanoqwen_kernels import KernelError
from nanoqwen_kernels.dims import TINY
from nanoqwen_kernels.gemv import GemvKernels
from nanoqwen_kernels.prefill import PrefillKernels


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


def test_prefill_gemm_f16_is_one_cublas_call_on_the_resident_weight(launches, monkeypatch):
    """gemm_f16: no dequantization launch, one GEMM reading w itself (N x K), beta as gemm_int4's; bad
    shapes and aliasing refused by name."""
    from nanoqwen_kernels import blas

    fake = FakeCublas()
    monkeypatch.setattr(blas, "_cublas", lambda: fake)
    p = PrefillKernels(TINY, load)
    w, X, out = dev((24, 256), np.float16), dev((5, 256), np.float16), dev((5, 24), np.float16)
    for acc, beta in ((False, 0.0), (True, 1.0)):
        p.gemm_f16(w, X, out, accumulate=acc)
        call = fake.calls[-1]
        assert call[0] == "gemmEx" and call[4:7] == (24, 5, 256)
        assert call[8] == w.data.ptr and call[15] == out.data.ptr and _f32_at(call[14]) == beta
    assert not launches  # nothing dequantized
    good = dict(w=w, X=X, out=out)
    assert_each_refused(
        p.gemm_f16,
        good,
        [
            ({"w": dev((24, 256), np.float32)}, "w must be float16"),
            ({"w": dev((24 * 256,), np.float16)}, r"w must be fp16 \[N, K\]"),
            ({"X": dev((5, 128), np.float16)}, r"X must be fp16 \[T, 256\]"),
            ({"out": dev((5, 23), np.float16)}, "out"),
            ({"out": X.reshape(-1)[:120].reshape(5, 24)}, "X and out overlap"),
        ],
    )


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


def test_prefill_gemm_int4_wg_launches_the_chosen_plan(launches, monkeypatch):
    """gemm_int4_wg: no cuBLAS, no fp16 weight; the grid is (token tiles, 128-row tiles, splits) of the plan
    choose_plan picks (or the one asked for), accumulate passed as an int; split-K adds one reduction launch
    over the workspace, which then carries accumulate instead. Bad shapes, a misaligned X, an unknown width,
    a split count past K's groups and a short workspace are refused by name before anything launches."""
    from nanoqwen_kernels import prefill_gemm as pg
    from nanoqwen_kernels import tma

    maps = []

    def fake_encode(ptr, rows, cols, box_rows, box_cols=64):
        maps.append((ptr, rows, cols, box_rows))
        return tma.TensorMap()

    monkeypatch.setattr(tma, "encode_rows_f16", fake_encode)
    p = PrefillKernels(TINY, load)
    qw, sc = dev((136, 256 // 8), np.uint32), dev((136, 2), np.float16)
    X, out = dev((300, 256), np.float16), dev((300, 136), np.float16)
    for acc in (False, True):
        n0 = len(launches)
        p.gemm_int4_wg(qw, sc, X, out, accumulate=acc)
        bn, s = pg.choose_plan(300, 136, 256, 132)
        fn, grid, args = launches[n0]
        assert fn == f"nq_gemm_int4_wg_n{bn}" and grid == (-(-300 // bn), 2, s)
        # X by its TMA map (encoded once for the buffer, boxes of bn tokens), then W, scales, out
        assert isinstance(args[0], tma.TensorMap) and maps == [(X.data.ptr, 300, 256, bn)]
        assert [a.data.ptr for a in args[1:4]] == [qw.data.ptr, sc.data.ptr, out.data.ptr]
        assert [int(a) for a in args[4:8]] == [300, 136, 256, int(acc)] and int(args[9]) == s
    p.gemm_int4_wg(qw, sc, X, out, tile=64, splits=1)
    assert launches[-1][0] == "nq_gemm_int4_wg_n64" and launches[-1][1] == (5, 2, 1)
    ws = dev((2 * 300 * 136,), np.float32)
    n0 = len(launches)
    p.gemm_int4_wg(qw, sc, X, out, accumulate=True, tile=128, splits=2, workspace=ws)
    (fn, grid, args), (fn2, _, args2) = launches[n0:]
    assert fn == "nq_gemm_int4_wg_n128" and grid == (3, 2, 2) and args[8].data.ptr == ws.data.ptr
    assert fn2 == "nq_gemm_splitk_reduce" and args2[0].data.ptr == ws.data.ptr and args2[1].data.ptr == out.data.ptr
    assert [int(a) for a in args2[2:]] == [300, 136, 2, 1]
    good = dict(qweight=qw, scales=sc, X=X, out=out)
    assert_each_refused(
        lambda **kw: p.gemm_int4_wg(**kw),
        good,
        [
            ({"X": dev((300, 128), np.float16)}, r"X must be fp16 \[T, 256\]"),
            ({"out": dev((300, 128), np.float16)}, "out must have shape"),
            ({"scales": dev((136, 3), np.float16)}, "scales must have shape"),
            ({"qweight": dev((132, 32), np.uint32), "scales": dev((132, 2), np.float16),
              "out": dev((300, 132), np.float16)}, "N % 8"),
            ({"X": dev((300 * 256 + 1,), np.float16)[1:].reshape(300, 256)}, "X must be 16-byte aligned"),
            ({"tile": 96}, "tile must be one of"),
            ({"splits": 3}, "splits must be an int in 1 .. K / 128 = 2"),
            ({"splits": 2, "workspace": dev((300 * 136,), np.float32)}, "workspace needs at least"),
        ],
    )
    n = len(launches)
    with pytest.raises(KernelError, match="X and out overlap"):
        p.gemm_int4_wg(qw, sc, X, X.reshape(-1)[:300 * 136].reshape(300, 136))
    assert len(launches) == n


def test_tma_map_of_the_activations_is_encoded_as_the_kernel_reads_it(monkeypatch):
    """tma.encode_rows_f16 asks the driver for a 2-D fp16 map, dims innermost first (K, T), the row pitch
    in bytes, boxes of 64 k x bn tokens, the 128-byte swizzle and zero fill; a driver error or a misaligned
    source is one KernelError."""
    import ctypes

    from nanoqwen_kernels import tma

    seen = {}

    def fake(tmap, dtype, rank, addr, dims, strides, box, elem, inter, swz, l2, oob):
        seen.update(dtype=dtype, rank=rank, addr=addr.value, dims=list(dims[:2]), strides=list(strides[:1]),
                    box=list(box[:2]), elem=list(elem[:2]), inter=inter, swz=swz, oob=oob)
        ctypes.cast(tmap, ctypes.POINTER(tma.TensorMap)).contents.opaque[0] = 42
        return seen.get("rc", 0)

    monkeypatch.setattr(tma, "_encoder", lambda: fake)
    m = tma.encode_rows_f16(0x10000, 513, 3584, 256)
    assert m.opaque[0] == 42 and ctypes.sizeof(m) == 128
    assert seen == dict(dtype=tma.CU_TENSOR_MAP_DATA_TYPE_FLOAT16, rank=2, addr=0x10000, dims=[3584, 513],
                        strides=[3584 * 2], box=[64, 256], elem=[1, 1], inter=0, swz=tma.CU_TENSOR_MAP_SWIZZLE_128B,
                        oob=tma.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    with pytest.raises(KernelError, match="16-byte aligned"):
        tma.encode_rows_f16(0x10008, 513, 3584, 256)
    seen["rc"] = 1
    with pytest.raises(KernelError, match="cuTensorMapEncodeTiled failed with CUresult 1"):
        tma.encode_rows_f16(0x10000, 513, 3584, 256)


def test_prefill_gemm_int4_wg_silu_launch(launches, monkeypatch):
    """gemm_int4_wg_silu: one launch of the SiLU build over (token tiles, 2I / 128 tiles), out [T, I], no
    split; a wrong output shape or a row count off the 128-row tile refused before anything launches."""
    from nanoqwen_kernels import tma

    monkeypatch.setattr(tma, "encode_rows_f16", lambda *a, **k: tma.TensorMap())
    p = PrefillKernels(TINY, load)
    qw, sc = dev((1024, 256 // 8), np.uint32), dev((1024, 2), np.float16)
    X, out = dev((300, 256), np.float16), dev((300, 512), np.float16)
    p.gemm_int4_wg_silu(qw, sc, X, out, tile=128)
    fn, grid, args = launches[-1]
    assert fn == "nq_gemm_int4_wg_silu_n128" and grid == (3, 8, 1) and args[3].data.ptr == out.data.ptr
    assert [int(a) for a in args[4:8]] == [300, 1024, 256, 0] and int(args[9]) == 1
    n = len(launches)
    assert_each_refused(
        lambda **kw: p.gemm_int4_wg_silu(**kw),
        dict(qweight=qw, scales=sc, X=X, out=out),
        [
            ({"out": dev((300, 1024), np.float16)}, "out must have shape"),
            ({"qweight": dev((960, 32), np.uint32), "scales": dev((960, 2), np.float16),
              "out": dev((300, 480), np.float16)}, "2I % 128"),
            ({"X": dev((300, 128), np.float16)}, r"X must be fp16 \[T, 256\]"),
        ],
    )
    assert len(launches) == n


def test_fp8_launchers_launch_the_plan_and_refuse_bad_shapes(launches, monkeypatch):
    """The FP8 prefill's launchers: quantize_e4m3 one block per token row with the row in dynamic shared
    memory (2 K bytes); rmsnorm_e4m3 one block per row; gemm_fp8 persistent blocks (one per tile up to one
    per SM) over the plan's tiles with X's and W's TMA maps (boxes of bn tokens and of 128 rows) and the
    tile order's band, split-K's reduction launch after it; gemm_fp8_silu one split. Bad
    shapes, dtypes and a short scale vector are refused by name before anything launches."""
    from nanoqwen_kernels import prefill_fp8 as f8
    from nanoqwen_kernels import prefill_gemm as pg
    from nanoqwen_kernels import tma

    maps = []

    def fake_encode(ptr, rows, cols, box_rows):
        maps.append((ptr, rows, cols, box_rows))
        return tma.TensorMap()

    monkeypatch.setattr(tma, "encode_rows_u8", fake_encode)
    p = PrefillKernels(TINY, load)
    X, xq, sx = dev((300, 256), np.float16), dev((300, 256), np.uint8), dev((300,), np.float32)
    p.quantize_e4m3(X, xq, sx)
    fn, grid, args = launches[-1]
    assert fn == "nq_quantize_e4m3_rows" and grid == (300, 1, 1) and int(args[3]) == 256
    p.rmsnorm_e4m3(dev((300, 256), np.float16), dev((256,), np.float16), xq, sx, 1e-6)
    assert launches[-1][0] == "nq_rmsnorm_e4m3_rows" and launches[-1][1] == (300, 1, 1)

    w8, sw = dev((136, 256), np.uint8), dev((2, f8.n_pad(136)), np.float32)
    out = dev((300, 136), np.float16)
    p.gemm_fp8(w8, sw, xq, sx, out, accumulate=True)
    bn, s = pg.choose_plan_fp8(300, 136, 256, 132)
    fn, grid, args = launches[-1 - (s > 1)]
    assert fn == f"nq_gemm_fp8_wg_n{bn}" and grid == (min(-(-300 // bn) * 2 * s, 132), 1, 1)
    assert maps[:2] == [(xq.data.ptr, 300, 256, bn), (w8.data.ptr, 136, 256, 128)]
    assert [int(a) for a in args[5:10]] == [300, 136, 256, f8.n_pad(136), 1]
    assert int(args[11]) == s and int(args[12]) == pg.GF8_BAND == 8
    ws = dev((2 * 300 * 136,), np.float32)
    n = len(launches)
    p.gemm_fp8(w8, sw, xq, sx, out, tile=64, splits=2, workspace=ws)
    assert [c[0] for c in launches[n:]] == ["nq_gemm_fp8_wg_n64", "nq_gemm_splitk_reduce"]
    assert launches[n][1] == (5 * 2 * 2, 1, 1)  # 5 token blocks x 2 row blocks x 2 splits
    gu8, gsw, act = dev((1024, 256), np.uint8), dev((2, 1024), np.float32), dev((300, 512), np.float16)
    p.gemm_fp8_silu(gu8, gsw, xq, sx, act, tile=128)
    assert launches[-1][0] == "nq_gemm_fp8_wg_silu_n128" and launches[-1][1] == (3 * 8, 1, 1)
    n = len(launches)
    assert_each_refused(
        lambda **kw: p.gemm_fp8(**kw),
        dict(w8=w8, sw=sw, xq=xq, sx=sx, out=out),
        [
            ({"sx": dev((299,), np.float32)}, r"sx must be float32 \[>= 300\]"),
            ({"sw": dev((2, 136), np.float32)}, "sw must have shape"),
            ({"w8": dev((136, 200), np.uint8)}, r"w8 must be uint8 \[N, K\]"),
            ({"xq": dev((300, 128), np.uint8)}, r"xq must be uint8 \[T, 256\]"),
            ({"out": dev((300, 128), np.float16)}, "out must have shape"),
        ],
    )
    assert_each_refused(
        lambda **kw: p.quantize_e4m3(**kw),
        dict(X=X, xq=xq, sx=sx),
        [
            ({"X": dev((300, 200), np.float16)}, "K % 128"),
            ({"xq": dev((300, 256), np.int8)}, "xq"),
            ({"sx": dev((3,), np.float32)}, r"sx must be float32 \[>= 300\]"),
        ],
    )
    assert len(launches) == n
