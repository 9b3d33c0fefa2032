"""gpu_status(): is there a usable Hopper GPU and CuPy here? GPU tests skip with its reason."""

from __future__ import annotations

import functools


@functools.cache
def gpu_status() -> tuple[bool, str]:
    """(ok, reason). Never raises: any failure to import CuPy or query the driver is a reason."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a broken CUDA install raising at import
        return False, f"CuPy not importable: {e}"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return False, f"no CUDA device: {e}"
    if n < 1:
        return False, "no CUDA device present"
    try:
        cc = cupy.cuda.Device().compute_capability  # e.g. "90"
    except Exception as e:
        return False, f"cannot query the CUDA device: {e}"
    if not cc.startswith("9"):
        return False, f"device compute capability {cc[:-1]}.{cc[-1]} is not 9.x (Hopper)"
    return True, f"sm_{cc} device present"
