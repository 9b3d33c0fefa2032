"""nanoqwen_kernels: the sm_90 kernel set (CUDA sources as package data), its NVRTC loader with a disk
cache, and thin typed launchers. Importing this package needs neither CuPy nor a GPU."""

from .dims import ModelDims
from .errors import KernelError
from .gpu import gpu_status

__version__ = "0.1.0"
__all__ = ["KernelError", "KernelSet", "ModelDims", "gpu_status"]


def __getattr__(name: str):
    # KernelSet pulls in CuPy-facing modules; resolve it lazily so `import nanoqwen_kernels` stays light
    if name == "KernelSet":
        from .kernelset import KernelSet

        return KernelSet
    raise AttributeError(name)
