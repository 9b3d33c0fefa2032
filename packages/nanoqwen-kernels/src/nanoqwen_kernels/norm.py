"""Launcher for RMSNorm (cuda/rmsnorm.cu): the final norm of B sequences at decode, T prompt rows at
prefill. One kernel, one block per row."""

from __future__ import annotations

import numpy as np

from . import checks as ck
from .dims import ModelDims
from .errors import KernelError


class NormKernels:
    def __init__(self, dims: ModelDims, load_module):
        self.dims = dims
        self._rms = load_module(["rmsnorm.cu"], dims.defines()).get_function("nq_rmsnorm_rows")

    def rmsnorm(self, x, w, out, eps) -> None:
        """out[B, H] = RMSNorm(x[B, H]) * w, row by row (a 1-D x is one row); out may be x itself."""
        h = self.dims.hidden
        ck.check_array("x", x, np.float16, align=16)
        rows = ck.batch_rows("x", x, h)
        ck.check_array("w", w, np.float16, (h,), align=16)
        ck.check_array("out", out, np.float16, tuple(x.shape), align=16)
        if out.data.ptr != x.data.ptr:
            ck.check_distinct(x=x, out=out)
        ck.launch(self._rms, rows, 256, (x, w, out, ck.check_eps(eps)))

    def rmsnorm_rows(self, x, w, out, eps) -> None:
        """The prefill form: x must be 2-D [T, H] (T prompt rows); otherwise as rmsnorm."""
        ck.check_array("x", x, np.float16, align=16)
        if x.ndim != 2:
            raise KernelError(f"x must be [T, {self.dims.hidden}] with T >= 1, got {tuple(x.shape)}")
        self.rmsnorm(x, w, out, eps)
