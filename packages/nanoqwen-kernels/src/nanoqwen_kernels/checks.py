"""Argument checks and launch helpers shared by every launcher: a bad argument is one KernelError naming
it, raised before anything reaches the GPU (never a CUDA fault or a traceback from inside CuPy).

The array checks are duck-typed on what a launch needs (a C-contiguous array with a device pointer,
`a.data.ptr`), so they run on a CPU machine too: the CI tests stand device arrays in with host arrays
that expose such a pointer. A numpy array has no `data.ptr` and is refused as "not a CuPy array".
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np

from . import pdl
from .dims import HEAD_DIM, PAGE_TOKENS, ModelDims
from .errors import KernelError

NULL = np.uint64(0)  # a null pointer argument (the kernels' optional inputs)


def cupy_module():
    """CuPy, imported on first use (importing nanoqwen_kernels needs neither CuPy nor a GPU)."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a broken CUDA install raising at import
        raise KernelError(f"CuPy is needed to launch kernels: {e}") from None
    return cupy


def check_array(
    name: str,
    a: Any,
    dtype,
    shape: tuple | None = None,
    *,
    min_size: int | None = None,
    align: int = 0,
) -> Any:
    """a: a C-contiguous device array of `dtype`; of `shape` when given, of at least `min_size` elements
    when given, and `align`-byte aligned when the kernel reads it in pieces of that size."""
    if not hasattr(getattr(a, "data", None), "ptr") or not hasattr(a, "flags"):
        raise KernelError(f"{name} must be a CuPy array, got {type(a).__name__}")
    if a.dtype != np.dtype(dtype):
        raise KernelError(f"{name} must be {np.dtype(dtype).name}, got {a.dtype.name}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise KernelError(f"{name} must have shape {tuple(shape)}, got {tuple(a.shape)}")
    if min_size is not None and a.size < min_size:
        raise KernelError(f"{name} needs at least {min_size} elements, got {a.size}")
    if not a.flags.c_contiguous:
        raise KernelError(f"{name} must be C-contiguous")
    if align and a.data.ptr % align:
        raise KernelError(f"{name} must be {align}-byte aligned (the kernel loads it in {align}-byte pieces)")
    return a


def check_int(name: str, v: Any, lo: int, hi: int | None = None) -> int:
    """v: an int (not a bool) in [lo, hi); hi None: unbounded."""
    if isinstance(v, bool) or not isinstance(v, int | np.integer):
        raise KernelError(f"{name} must be an int, got {type(v).__name__}")
    v = int(v)
    if v < lo or (hi is not None and v >= hi):
        raise KernelError(f"{name} = {v} out of range [{lo}, {'inf' if hi is None else hi})")
    return v


def check_eps(eps: Any) -> np.float32:
    """The RMSNorm epsilon: a float in (0, 1), passed to the kernels as fp32."""
    if isinstance(eps, bool) or not isinstance(eps, int | float | np.floating) or not (0 < float(eps) < 1):
        raise KernelError(f"eps must be a float in (0, 1), got {eps!r}")
    return np.float32(eps)


def check_distinct(**arrays: Any) -> None:
    """Inputs read by every block must not share memory with an output (a race, not an error CUDA sees).
    None entries are skipped."""
    items = [(n, a) for n, a in arrays.items() if a is not None]
    for i, (n1, a1) in enumerate(items):
        lo1, hi1 = a1.data.ptr, a1.data.ptr + a1.nbytes
        for n2, a2 in items[i + 1 :]:
            lo2, hi2 = a2.data.ptr, a2.data.ptr + a2.nbytes
            if lo1 < hi2 and lo2 < hi1:
                raise KernelError(f"{n1} and {n2} overlap in memory; the kernel needs them apart")


def check_kv_cache(dims: ModelDims, k_cache: Any, v_cache: Any, layer: Any) -> tuple[int, int]:
    """k/v_cache fp16 [n_layers, n_pages, n_kv_heads, 16, 128], the same shape; layer in range.
    Returns (layer, n_pages)."""
    check_array("k_cache", k_cache, np.float16)
    check_array("v_cache", v_cache, np.float16)
    if k_cache.ndim != 5 or tuple(k_cache.shape[2:]) != (dims.n_kv_heads, PAGE_TOKENS, HEAD_DIM):
        raise KernelError(
            f"k_cache must be [n_layers, n_pages, {dims.n_kv_heads}, {PAGE_TOKENS}, {HEAD_DIM}], "
            f"got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise KernelError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")
    layer = check_int("layer", layer, 0, k_cache.shape[0])
    return layer, int(k_cache.shape[1])


def check_page_table(page_table: Any, rows: int | None = None) -> Any:
    """One sequence's page table, int32 [max_pages] (rows None), or one per row of a batch,
    int32 [rows, max_pages] (row b = sequence b's table); max_pages >= 1."""
    check_array("page_table", page_table, np.int32)
    if rows is None:
        if page_table.ndim != 1 or page_table.size < 1:
            raise KernelError(
                f"page_table must be a non-empty 1-D int32 array, got shape {tuple(page_table.shape)}"
            )
    elif page_table.ndim != 2 or page_table.shape[0] != rows or page_table.shape[1] < 1:
        raise KernelError(
            f"page_table must be int32 [{rows}, max_pages] (one row per sequence), "
            f"got shape {tuple(page_table.shape)}"
        )
    return page_table


def batch_rows(name: str, x: Any, width: int, max_rows: int | None = None) -> int:
    """B of a batch-shaped activation: x is [B, width] (or [width], B = 1). Returns B (>= 1)."""
    if x.ndim == 1 and x.shape[0] == width:
        return 1
    if x.ndim != 2 or x.shape[1] != width or x.shape[0] < 1:
        raise KernelError(f"{name} must be [B, {width}] (or [{width}] for B = 1), got {tuple(x.shape)}")
    b = int(x.shape[0])
    if max_rows is not None and b > max_rows:
        raise KernelError(f"{name} has {b} rows; at most {max_rows} are supported")
    return b


def sm_count(device_id: int | None = None) -> int:
    """Streaming multiprocessors of a device (the current CuPy device when None)."""
    return _sm_count(cupy_module().cuda.Device().id if device_id is None else int(device_id))


@functools.cache
def _sm_count(device_id: int) -> int:
    return int(cupy_module().cuda.Device(device_id).attributes["MultiProcessorCount"])


@functools.cache
def _resident_blocks(fn_ptr: int, threads: int, shared_mem: int) -> int:
    from cupy_backends.cuda.api import driver

    return max(1, int(driver.occupancyMaxActiveBlocksPerMultiprocessor(fn_ptr, threads, shared_mem)))


def even_grid(fn, block_units: int, threads: int, shared_mem: int = 0, copies: int = 1) -> int:
    """Blocks for a grid-stride kernel: at most what is resident at once (the occupancy API's answer for
    this kernel's registers and shared memory), shared by `copies` grids side by side (grid.y), and
    every block running the same number of iterations (no ragged last wave)."""
    cap = max(1, sm_count() * _resident_blocks(fn.ptr, threads, shared_mem) // copies)
    iters = -(-block_units // cap)
    return max(1, -(-block_units // iters))


def set_function_attribute(fn, attribute: int, value: int) -> None:
    """cuFuncSetAttribute on a loaded kernel (CuPy's driver binding): e.g. non-portable cluster sizes."""
    cupy_module().cuda.driver.funcSetAttribute(fn.ptr, attribute, value)


def max_active_clusters(fn, grid: tuple, block: tuple, shared_mem: int, cluster: tuple) -> int:
    """Clusters of this launch shape resident at once on the current device (pdl.max_active_clusters)."""
    return pdl.max_active_clusters(fn, grid, block, shared_mem, cluster)


def launch(fn, grid: int | tuple, block: int | tuple, args: tuple, shared_mem: int = 0,
           cluster: tuple | None = None) -> None:
    """On the current CuPy stream, named explicitly so a graph capture on it records the launch.
    grid/block: an int (1-D) or a tuple. On Hopper every kernel goes out with programmatic dependent
    launch (pdl.py: it may start while the previous kernel drains); $NANOQWEN_PDL=0 launches plainly.
    cluster: thread-block cluster dims (x, y, z) dividing the grid's (always through cuLaunchKernelEx:
    CuPy's launch has no cluster argument)."""
    cupy = cupy_module()
    grid = grid if isinstance(grid, tuple) else (grid,)
    block = block if isinstance(block, tuple) else (block,)
    stream = cupy.cuda.get_current_stream()
    use_pdl = pdl.supported(cupy.cuda.Device().id)
    if (use_pdl or (cluster is not None and cluster != (1, 1, 1))
            or any(isinstance(a, ctypes.Structure) for a in args)):  # CuPy's launch cannot pass one by value
        pdl.launch(fn, grid, block, args, shared_mem, stream.ptr, cluster=cluster, programmatic=use_pdl)
    else:
        fn(grid, block, args, shared_mem=shared_mem, stream=stream)


def workspace_f32(workspace, size: int):
    """A split-K GEMM's fp32 scratch: `workspace` checked (float32, >= size elements, 16-byte aligned), or one
    from CuPy's pool when None (which a graph capture must not do: the engine passes its own)."""
    if workspace is None:
        workspace = cupy_module().empty(size, dtype=np.float32)
    check_array("workspace", workspace, np.float32, min_size=size, align=16)
    return workspace
