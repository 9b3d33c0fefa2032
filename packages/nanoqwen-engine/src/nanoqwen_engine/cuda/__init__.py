"""nanoqwen_engine.cuda: the GPU backend (CudaBackend) behind the Engine's Backend protocol.

Importing this package needs neither CuPy nor a GPU (CudaBackend.create checks both and raises
NoGPUError with the reason); the pure-Python parts (plan.py, validation helpers) are tested in CI.
"""

from .backend import CudaBackend
from .errors import GPUBackendError, GPUOutOfMemoryError, WrongGPUError

__all__ = ["CudaBackend", "GPUBackendError", "GPUOutOfMemoryError", "WrongGPUError"]
