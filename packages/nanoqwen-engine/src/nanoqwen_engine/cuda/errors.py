"""The GPU backend's own failures, all NanoqwenError subclasses (the engine's errors.py has the rest)."""

from __future__ import annotations

from ..errors import NanoqwenError, NoGPUError


class WrongGPUError(NoGPUError):
    """A CUDA device is present but it is not a Hopper (sm_90) GPU, which the kernels are built for."""


class GPUOutOfMemoryError(NanoqwenError):
    """The GPU ran out of memory (loading the model, or one request); a failed request leaves the model
    loaded and usable."""


class GPUBackendError(NanoqwenError):
    """The kernels could not be built for this model, or a launch failed."""
