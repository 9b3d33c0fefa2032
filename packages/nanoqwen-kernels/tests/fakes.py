"""Host arrays posing as device arrays, so the launchers' argument checks and launch plans run on a CPU:
the checks are duck-typed on exactly what a launch needs (dtype, shape, flags, nbytes, data.ptr)."""

import re
from types import SimpleNamespace

import numpy as np


class Dev:
    """A host array posing as a device array: dtype/shape/flags/nbytes and data.ptr."""

    def __init__(self, a):
        self.a = a
        self.dtype, self.shape, self.ndim, self.size, self.nbytes = a.dtype, a.shape, a.ndim, a.size, a.nbytes
        self.flags = a.flags
        self.data = SimpleNamespace(ptr=a.ctypes.data)

    def __getitem__(self, key):  # a view, as a device array's slice is
        return Dev(self.a[key])

    def reshape(self, *shape):
        return Dev(self.a.reshape(*shape))


def dev(shape, dtype):
    # over-allocate and align to 256 bytes like a CUDA allocation
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.zeros(n + 256, dtype=np.uint8)
    off = (-raw.ctypes.data) % 256
    return Dev(raw[off : off + n].view(dtype).reshape(shape))


def assert_each_refused(call, good: dict, bad) -> None:
    """For each (change, pattern) of `bad`: call(**{**good, **change}) raises a KernelError matching
    pattern (the launchers' contract: a bad argument is refused by name before anything launches)."""
    from nanoqwen_kernels import KernelError

    for change, pattern in bad:
        try:
            call(**{**good, **change})
        except KernelError as e:
            assert re.search(pattern, str(e)), f"{sorted(change)}: {e!r} does not match {pattern!r}"
        else:
            raise AssertionError(f"{sorted(change)} was not refused")


def fake_cupy() -> SimpleNamespace:
    """What the launchers ask of CuPy on a CPU: host buffers for their workspaces, and the current
    stream (blas.py binds its cuBLAS handle to it)."""
    return SimpleNamespace(empty=lambda *a, **k: Dev(np.empty(*a, **k)),
                           zeros=lambda *a, **k: Dev(np.zeros(*a, **k)),
                           cuda=SimpleNamespace(get_current_stream=lambda: SimpleNamespace(ptr=0)))


class Loaded:
    """A loaded module whose functions are their names: what a launch records."""

    def get_function(self, name, max_dynamic_smem=0):
        return name


def load(sources, defines):
    """A loader for the launcher classes that compiles nothing."""
    return Loaded()
