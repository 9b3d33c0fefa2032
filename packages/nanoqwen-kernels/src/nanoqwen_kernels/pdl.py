"""Kernel launches with programmatic dependent launch (PDL): cuLaunchKernelEx through ctypes.

Why: a decode step is ~170 small kernels in a CUDA graph, and between two plain launches the GPU drains
the first grid, flushes its writes, then processes the second launch and places its blocks: an idle gap
at every kernel boundary. With the launch attribute CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
the second kernel's launch is processed while the first drains and its blocks are placed as the first
one's blocks exit; each entry then blocks in `griddepcontrol.wait` until the first kernel has completed
and its writes are visible (the contract of every entry: cuda/common.cuh, "programmatic dependent
launch"). A stream capture turns the attribute into a programmatic graph edge, so the captured decode
graphs keep it. Measured on the H200 (7B, docs/PERF.md "Launch overlap"): decode at depth 0 2.20 ->
2.12 ms/token, the batch-1 step of the batched protocol 2.24 -> 2.09 ms; B >= 8 unchanged. Releasing the
next kernel early (griddepcontrol.launch_dependents at entry) measured slower and is not used.

CuPy's launch (`Function.__call__`) takes no launch attributes, so this module builds the driver's
CUlaunchConfig itself and calls cuLaunchKernelEx from libcuda (already loaded by CuPy). Arguments are
marshalled as CuPy would: a device array is its pointer, a numpy scalar its value in its C type (int32,
float32, the uint64 null pointer); a ctypes structure (tma.TensorMap) goes by value, as its bytes.

Switch: $NANOQWEN_PDL = 0 launches every kernel plainly (through CuPy); default on, on compute capability
>= 9.0 (the attribute needs Hopper; the kernels are built for sm_90a).
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

from .errors import KernelError

# cuda.h: CUlaunchAttributeID
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: the id, 4 bytes of padding, a 64-byte value union (here its first int)."""

    _fields_ = [("id", ctypes.c_uint32), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int32 * 16)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [
        ("gridDimX", ctypes.c_uint32),
        ("gridDimY", ctypes.c_uint32),
        ("gridDimZ", ctypes.c_uint32),
        ("blockDimX", ctypes.c_uint32),
        ("blockDimY", ctypes.c_uint32),
        ("blockDimZ", ctypes.c_uint32),
        ("sharedMemBytes", ctypes.c_uint32),
        ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttribute)),
        ("numAttrs", ctypes.c_uint32),
    ]


def enabled_by_env() -> bool:
    """$NANOQWEN_PDL: unset or anything but 0/off/false means on."""
    return os.environ.get("NANOQWEN_PDL", "1").strip().lower() not in ("0", "off", "false", "no")


# numpy scalar type -> the ctypes type holding its value as the kernel reads it
_SCALARS = {np.int32: ctypes.c_int32, np.uint32: ctypes.c_uint32, np.int64: ctypes.c_int64,
            np.uint64: ctypes.c_uint64, np.float32: ctypes.c_float, np.float64: ctypes.c_double}


def pack_args(args: tuple) -> tuple[ctypes.Array, list]:
    """(void*[] kernelParams, the buffers it points into: keep them alive until the launch returns)."""
    bufs: list = []
    for i, a in enumerate(args):
        if isinstance(a, ctypes.Structure):  # passed by value as its bytes (tma.TensorMap)
            bufs.append(a)
            continue
        ctype = _SCALARS.get(type(a))
        if ctype is not None:
            bufs.append(ctype(a.item()))
            continue
        try:
            ptr = a.data.ptr  # a device array (CuPy, or the tests' fakes)
        except AttributeError:
            raise KernelError(
                f"kernel argument {i} is a {type(a).__name__}: pass a device array or a numpy scalar "
                "(np.int32, np.float32, checks.NULL)"
            ) from None
        bufs.append(ctypes.c_uint64(ptr))
    params = (ctypes.c_void_p * max(1, len(bufs)))(*[ctypes.addressof(b) for b in bufs])
    return params, bufs


@functools.cache
def _attributes(programmatic: bool, cluster: tuple | None) -> tuple[ctypes.Array, int]:
    """(the attribute array, its length) for one combination, built once: every launch of a decode or
    prefill reuses it (read-only, alive for the process) instead of building ctypes objects per launch."""
    ids = ([CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION] if programmatic else []) + (
        [CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION] if cluster is not None else [])
    attrs = (LaunchAttribute * max(1, len(ids)))()
    for i, aid in enumerate(ids):
        attrs[i].id = aid
        if aid == CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION:
            for j in range(3):
                attrs[i].value[j] = cluster[j]
        else:
            attrs[i].value[0] = 1  # programmaticStreamSerializationAllowed
    return attrs, len(ids)


def make_config(grid: tuple, block: tuple, shared_mem: int, stream_ptr: int, cluster: tuple | None = None,
                programmatic: bool = True) -> LaunchConfig:
    """The launch config, carrying the PDL attribute (programmatic) and the cluster dims (cluster, when
    given: value = {x, y, z}, each dividing the grid's)."""
    g = (*grid, 1, 1)
    b = (*block, 1, 1)
    if cluster is not None:
        cluster = (*cluster, 1, 1)[:3]
        if any(c < 1 or gd % c for c, gd in zip(cluster, g[:3], strict=True)):
            raise KernelError(f"cluster {cluster} does not divide grid {tuple(grid)}")
    attrs, n = _attributes(programmatic, cluster)
    return LaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], shared_mem, stream_ptr, attrs, n)


@functools.cache
def _driver() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise KernelError(f"libcuda.so.1 not loadable for cuLaunchKernelEx: {e}") from None
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    lib.cuOccupancyMaxActiveClusters.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                                                 ctypes.POINTER(LaunchConfig)]
    lib.cuOccupancyMaxActiveClusters.restype = ctypes.c_int
    return lib


def max_active_clusters(fn, grid: tuple, block: tuple, shared_mem: int, cluster: tuple) -> int:
    """How many clusters of this launch shape the device holds at once (cuOccupancyMaxActiveClusters: this
    kernel's registers and shared memory, and the cluster's placement in one GPC)."""
    cfg = make_config(grid, block, shared_mem, 0, cluster, programmatic=False)
    n = ctypes.c_int(0)
    rc = _driver().cuOccupancyMaxActiveClusters(ctypes.byref(n), fn.ptr, ctypes.byref(cfg))
    if rc != 0:
        raise KernelError(f"cuOccupancyMaxActiveClusters failed with CUresult {rc} (grid {grid}, block {block}, "
                          f"{shared_mem} B shared, cluster {cluster})")
    return int(n.value)


@functools.cache
def supported(device_id: int) -> bool:
    """PDL on this device: compute capability 9.0 or newer, and the switch on."""
    import cupy

    return enabled_by_env() and int(cupy.cuda.Device(device_id).compute_capability) >= 90


def launch(fn, grid: tuple, block: tuple, args: tuple, shared_mem: int, stream_ptr: int,
           cluster: tuple | None = None, programmatic: bool = True) -> None:
    """fn (a CuPy Function, .ptr = CUfunction) on the stream, with the PDL attribute (programmatic) and
    thread-block cluster dims (cluster)."""
    cfg = make_config(grid, block, shared_mem, stream_ptr, cluster, programmatic)
    params, bufs = pack_args(args)
    rc = _driver().cuLaunchKernelEx(ctypes.byref(cfg), fn.ptr, params, None)
    del bufs  # (alive until here: the driver copies the parameters during the call)
    if rc != 0:
        raise KernelError(f"cuLaunchKernelEx failed with CUresult {rc} (grid {grid}, block {block}, "
                          f"{shared_mem} B shared, cluster {cluster}); set NANOQWEN_PDL=0 to launch without PDL")
