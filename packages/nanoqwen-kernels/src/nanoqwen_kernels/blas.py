"""The cuBLAS calls of the kernel set: fp16 x fp16 GEMMs with fp32 accumulation, on the current stream.

Two places multiply by a dense fp16 matrix at more than a handful of rows, where cuBLAS's Hopper GEMMs
are at the bandwidth or compute limit and a hand-written kernel would only match them:
  - the lm_head of a decode batch (B > 1): logits f32 [B, V] = x f16 [B, H] . W f16 [V, H]^T. The GEMV
    core (gemv_mma.cuh) stages x in shared memory and, above ~28 sequences, needs a second and third
    pass over the 1.09 GB of the 7B's lm_head; cuBLAS reads W once;
  - the prefill GEMMs: out f16 [T, N] = X f16 [T, K] . W f16 [N, K]^T (+ beta * out, the residual
    add folded into the GEMM), W the INT4 weight dequantized into a scratch buffer.

Why not cupy.matmul: it cannot write fp32 from fp16 inputs (the logits must not round to fp16 before
sampling: near-ties), cannot accumulate into its output (beta = 1), costs ~20 us of Python per call
where the prefill makes ~4 calls per layer, and (like all of CuPy's cuBLAS wrapper) refuses to run
while a stream captures a graph. This calls cublasGemmEx through ctypes on a handle of its own (so
CuPy's handle keeps its stream and mode), with the stream set per call: inside a CUDA graph capture the
call is recorded like a kernel launch. cuBLAS (12.2 and later) takes its
workspace with cudaMallocAsync on that stream, which a capture records too, so no workspace is set.

Layout: all arrays are row-major (C order); cuBLAS is column-major. A row-major [R, C] array is a
column-major [C, R] one with the same bytes, so out^T = W . X^T in column-major terms is
out (N x T, ld N) = op_T(W as K x N, ld K) . X as (K x T, ld K): transa = T, transb = N, m = N, n = T.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from . import checks as ck
from .errors import KernelError

# cudaDataType_t / cublasOperation_t / cublasComputeType_t / cublasGemmAlgo_t values (cublas_api.h,
# library_types.h): stable ABI constants
CUDA_R_32F = 0
CUDA_R_16F = 2
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1


class _CublasLib:
    """cublasCreate / cublasSetStream / cublasGemmEx called straight through ctypes. Not CuPy's
    wrapper: it refuses every cuBLAS call while a stream is capturing ("calling cuBLAS API during
    stream capture is currently unsupported"), and capturing the lm_head into the decode step's graph
    is the point. The library is the one CuPy loaded (found in the process's mappings), so there is
    one cuBLAS in the process."""

    def __init__(self, lib):
        c = ctypes
        self._lib = lib
        lib.cublasCreate_v2.argtypes = [c.POINTER(c.c_void_p)]
        lib.cublasSetStream_v2.argtypes = [c.c_void_p, c.c_void_p]
        lib.cublasGemmEx.argtypes = [c.c_void_p, c.c_int, c.c_int, c.c_int, c.c_int, c.c_int,
                                     c.c_void_p, c.c_void_p, c.c_int, c.c_int, c.c_void_p, c.c_int, c.c_int,
                                     c.c_void_p, c.c_void_p, c.c_int, c.c_int, c.c_int, c.c_int]
        for f in (lib.cublasCreate_v2, lib.cublasSetStream_v2, lib.cublasGemmEx):
            f.restype = c.c_int

    @staticmethod
    def _ok(status: int, what: str) -> None:
        if status != 0:  # cublasStatus_t: 0 = CUBLAS_STATUS_SUCCESS
            raise KernelError(f"cuBLAS {what} failed with status {status}")

    def create(self) -> int:
        h = ctypes.c_void_p()
        self._ok(self._lib.cublasCreate_v2(ctypes.byref(h)), "create")
        return int(h.value or 0)

    def setStream(self, handle: int, stream_ptr: int) -> None:  # noqa: N802 (cuBLAS's name)
        self._ok(self._lib.cublasSetStream_v2(handle, stream_ptr), "setStream")

    def gemmEx(self, *args) -> None:  # noqa: N802
        self._ok(self._lib.cublasGemmEx(*args), "GemmEx")


def _library_path() -> str | None:
    """The libcublas.so CuPy has loaded into this process, if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if "/libcublas.so" in path:
                    return path
    except OSError:
        pass
    return None


@functools.cache
def _cublas() -> _CublasLib:
    """cuBLAS, loaded on first use (no GPU needed to import nanoqwen_kernels)."""
    ck.cupy_module()
    try:
        from cupy_backends.cuda.libs import cublas  # noqa: F401  (loads libcublas into the process)
    except Exception as e:  # the library missing from the CUDA install
        raise KernelError(f"cuBLAS is needed for the batched lm_head and the prefill GEMMs: {e}") from None
    names = [p for p in (_library_path(),) if p] + ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]
    for name in names:
        try:
            return _CublasLib(ctypes.CDLL(name))
        except OSError:
            continue
    raise KernelError(f"cuBLAS is needed for the batched lm_head and the prefill GEMMs: none of {names} loads")


class Blas:
    """One cuBLAS handle (created on first use, on the current device) and the GEMMs above."""

    def __init__(self):
        self._handle: int | None = None
        # host-pointer-mode scalars, alive as long as the handle: cuBLAS reads them when the call is made
        self._one = np.ones(1, dtype=np.float32)
        self._zero = np.zeros(1, dtype=np.float32)

    def _ready(self):
        lib = _cublas()
        if self._handle is None:
            self._handle = lib.create()
        cupy = ck.cupy_module()
        lib.setStream(self._handle, cupy.cuda.get_current_stream().ptr)
        return lib

    def gemm_nt(self, x, w, out, accumulate: bool = False) -> None:
        """out[T, N] (f16 or f32) = x f16 [T, K] . w f16 [N, K]^T (+ out when accumulate), fp32 sums.

        Shapes and dtypes are the callers' to check (they name the arguments in their own terms);
        this checks only what cuBLAS would otherwise fault on: contiguity and matching sizes."""
        t, k = (int(s) for s in x.shape)
        n = int(w.shape[0])
        if tuple(w.shape) != (n, k) or tuple(out.shape) != (t, n):
            raise KernelError(f"gemm_nt: x {tuple(x.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)} do not chain")
        for name, a in (("x", x), ("w", w), ("out", out)):
            if not a.flags.c_contiguous:
                raise KernelError(f"gemm_nt: {name} must be C-contiguous")
        ctype = {np.dtype(np.float16): CUDA_R_16F, np.dtype(np.float32): CUDA_R_32F}.get(np.dtype(out.dtype))
        if ctype is None:
            raise KernelError(f"gemm_nt: out must be float16 or float32, got {out.dtype}")
        lib = self._ready()
        beta = self._one if accumulate else self._zero
        lib.gemmEx(
            self._handle, CUBLAS_OP_T, CUBLAS_OP_N, n, t, k,
            self._one.ctypes.data, w.data.ptr, CUDA_R_16F, k,
            x.data.ptr, CUDA_R_16F, k,
            beta.ctypes.data, out.data.ptr, ctype, n,
            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT,
        )
