"""Tensor maps for the Hopper tensor memory accelerator (TMA): the descriptor a `cp.async.bulk.tensor` copy
reads, built on the host by the driver's cuTensorMapEncodeTiled (libcuda through ctypes; CuPy does not wrap
it) and passed to the kernel by value as a 128-byte `__grid_constant__` parameter (pdl.pack_args).

Why TMA for the fused prefill GEMM's activations (cuda/gemm_int4_prefill.cu): with the X tile copied by
128 producer threads in 16-byte cp.async pieces, the GEMM ran at 566 TFLOP/s on the 7B's gate/up at
T = 2048, and 811 with those copies skipped (the weights and scales still copied, the dequantization
done): the copies were the bound (docs/PERF.md, "eleventh lease"). One thread's bulk tensor copy moves the
whole [BN tokens][64 k] tile, swizzled for wgmma, with no per-piece address arithmetic or issue slots.
"""

from __future__ import annotations

import ctypes
import functools

from .errors import KernelError

# cuda.h enums
CU_TENSOR_MAP_DATA_TYPE_UINT8 = 0
CU_TENSOR_MAP_DATA_TYPE_FLOAT16 = 6
CU_TENSOR_MAP_INTERLEAVE_NONE = 0
CU_TENSOR_MAP_SWIZZLE_128B = 3
CU_TENSOR_MAP_L2_PROMOTION_L2_256B = 3
CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0  # out-of-bounds elements read as zeros


class TensorMap(ctypes.Structure):
    """CUtensorMap: 128 opaque bytes, 64-byte aligned; a kernel argument by value."""

    _pack_ = 8
    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


@functools.cache
def _encoder():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise KernelError(f"libcuda.so.1 not loadable for cuTensorMapEncodeTiled: {e}") from None
    fn = lib.cuTensorMapEncodeTiled
    fn.argtypes = [ctypes.POINTER(TensorMap), ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                   ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32),
                   ctypes.POINTER(ctypes.c_uint32), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def encode_rows_f16(ptr: int, rows: int, cols: int, box_rows: int, box_cols: int = 64) -> TensorMap:
    """The map of a row-major fp16 matrix [rows][cols] at device address ptr, copied in boxes of box_rows
    rows x box_cols columns (box_cols x 2 = 128 bytes: one 128-byte swizzle row), each landing in shared
    memory as box_rows rows of 128 bytes with the 16-byte chunks XORed by the row's index mod 8: wgmma's
    K-major 128-byte-swizzle layout (cuda/wgmma.cuh). Rows past `rows` read as zeros."""
    if box_cols * 2 != 128:
        raise KernelError(f"box {box_rows} x {box_cols}: 64 fp16 columns (128 bytes)")
    return _encode_rows(ptr, rows, cols, box_rows, box_cols, 2, CU_TENSOR_MAP_DATA_TYPE_FLOAT16)


def encode_rows_u8(ptr: int, rows: int, cols: int, box_rows: int) -> TensorMap:
    """encode_rows_f16 for a matrix of bytes (the FP8 GEMM's e4m3 operands): boxes of box_rows x 128."""
    return _encode_rows(ptr, rows, cols, box_rows, 128, 1, CU_TENSOR_MAP_DATA_TYPE_UINT8)


def _encode_rows(ptr: int, rows: int, cols: int, box_rows: int, box_cols: int, elem_bytes: int, dtype: int) -> TensorMap:
    if ptr % 16 or (cols * elem_bytes) % 16:
        raise KernelError(f"a TMA source needs 16-byte aligned rows: address {ptr:#x}, {cols * elem_bytes}-byte rows")
    if not 1 <= box_rows <= 256:
        raise KernelError(f"box {box_rows} x {box_cols}: rows 1 .. 256")
    tmap = TensorMap()
    dims = (ctypes.c_uint64 * 2)(cols, rows)  # innermost first
    strides = (ctypes.c_uint64 * 1)(cols * elem_bytes)  # bytes between rows (the innermost stride is implied)
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    rc = _encoder()(ctypes.byref(tmap), dtype, 2, ctypes.c_void_p(ptr), dims, strides, box,
                    elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if rc != 0:
        raise KernelError(f"cuTensorMapEncodeTiled failed with CUresult {rc} ({rows} x {cols} x {elem_bytes} B, box "
                          f"{box_rows} x {box_cols})")
    return tmap
