"""Argument checks shared by the part-A launchers: one KernelError naming the argument, never a CUDA
fault or a traceback from inside CuPy."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .errors import KernelError


def cupy_module():
    try:
        import cupy
    except Exception as e:
        raise KernelError(f"CuPy is needed to launch kernels: {e}") from None
    return cupy


def array(name: str, a: Any, dtype, shape: tuple | None = None, align: int = 0) -> Any:
    """a: a C-contiguous CuPy array of `dtype` (and `shape` when given; `align`-byte aligned when the
    kernel reads it in 16-byte pieces)."""
    # duck-typed on what a launch needs (a device pointer), so the checks run on a CPU in CI too
    if not hasattr(getattr(a, "data", None), "ptr") or not hasattr(a, "flags"):
        raise KernelError(f"{name} must be a CuPy array, got {type(a).__name__}")
    if a.dtype != np.dtype(dtype):
        raise KernelError(f"{name} must be {np.dtype(dtype).name}, got {a.dtype.name}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise KernelError(f"{name} must have shape {tuple(shape)}, got {tuple(a.shape)}")
    if not a.flags.c_contiguous:
        raise KernelError(f"{name} must be C-contiguous")
    if align and a.data.ptr % align:
        raise KernelError(f"{name} must be {align}-byte aligned (the kernel loads it in {align}-byte pieces)")
    return a


def integer(name: str, v: Any, lo: int, hi: int | None = None) -> int:
    """v: an int in [lo, hi)."""
    if isinstance(v, bool) or not isinstance(v, int | np.integer):
        raise KernelError(f"{name} must be an int, got {type(v).__name__}")
    v = int(v)
    if v < lo or (hi is not None and v >= hi):
        raise KernelError(f"{name} = {v} is out of range [{lo}, {'inf' if hi is None else hi})")
    return v


def eps_value(eps: Any) -> np.float32:
    if isinstance(eps, bool) or not isinstance(eps, int | float | np.floating) or not (0 < float(eps) < 1):
        raise KernelError(f"eps must be a float in (0, 1), got {eps!r}")
    return np.float32(eps)


def distinct(**arrays: Any) -> None:
    """Inputs read by every block must not share memory with an output (a race, not an error CUDA sees)."""
    items = [(n, a) for n, a in arrays.items() if a is not None]
    for i, (n1, a1) in enumerate(items):
        lo1, hi1 = a1.data.ptr, a1.data.ptr + a1.nbytes
        for n2, a2 in items[i + 1 :]:
            lo2, hi2 = a2.data.ptr, a2.data.ptr + a2.nbytes
            if lo1 < hi2 and lo2 < hi1:
                raise KernelError(f"{n1} and {n2} overlap in memory; the kernel needs them apart")


@functools.cache
def sm_count(device_id: int) -> int:
    cupy = cupy_module()
    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


@functools.cache
def _resident_blocks(fn_ptr: int, threads: int) -> int:
    from cupy_backends.cuda.api import driver

    return max(1, int(driver.occupancyMaxActiveBlocksPerMultiprocessor(fn_ptr, threads, 0)))


def even_grid(fn, block_units: int, threads: int) -> int:
    """Blocks for a grid-stride kernel: at most what is resident at once (the occupancy API's answer for
    this kernel's registers and shared memory), and every block running the same number of iterations
    (no ragged last wave)."""
    cupy = cupy_module()
    cap = sm_count(cupy.cuda.Device().id) * _resident_blocks(fn.ptr, threads)
    iters = -(-block_units // cap)
    return max(1, -(-block_units // iters))


def launch(fn, grid: int, block: int, args: tuple, shared_mem: int = 0) -> None:
    """On the current CuPy stream, named explicitly so a graph capture on it records the launch."""
    cupy = cupy_module()
    fn((grid,), (block,), args, shared_mem=shared_mem, stream=cupy.cuda.get_current_stream())


NULL = np.uint64(0)  # a null pointer argument (the kernels' optional inputs)
