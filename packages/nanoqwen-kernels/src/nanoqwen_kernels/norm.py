"""Launchers for RMSNorm (cuda/rmsnorm.cu) and the embedding lookup (cuda/embed.cu)."""

from __future__ import annotations

import numpy as np

from . import checks as ck
from .dims import ModelDims
from .errors import KernelError


class NormKernels:
    def __init__(self, dims: ModelDims, load_module):
        self.dims = dims
        self._rms = load_module(["rmsnorm.cu"], dims.defines()).get_function("nq_rmsnorm_rows")
        self._embed = load_module(["embed.cu"], dims.defines()).get_function("nq_embed")

    def rmsnorm_rows(self, x, w, out, eps) -> None:
        """out[T, H] = RMSNorm(x[T, H]) * w; out may be x itself."""
        h = self.dims.hidden
        ck.check_array("x", x, np.float16, align=16)
        if x.ndim != 2 or x.shape[1] != h or x.shape[0] < 1:
            raise KernelError(f"x must be [T, {h}] with T >= 1, got {tuple(x.shape)}")
        ck.check_array("w", w, np.float16, (h,), align=16)
        ck.check_array("out", out, np.float16, tuple(x.shape), align=16)
        if out.data.ptr != x.data.ptr:
            ck.check_distinct(x=x, out=out)
        ck.launch(self._rms, int(x.shape[0]), 256, (x, w, out, ck.check_eps(eps)))

    def rmsnorm(self, x, w, out, eps) -> None:
        """out[H] = RMSNorm(x[H]) * w (the final norm at decode)."""
        h = self.dims.hidden
        ck.check_array("x", x, np.float16, (h,), align=16)
        ck.check_array("w", w, np.float16, (h,), align=16)
        ck.check_array("out", out, np.float16, (h,), align=16)
        if out.data.ptr != x.data.ptr:
            ck.check_distinct(x=x, out=out)
        ck.launch(self._rms, 1, 256, (x, w, out, ck.check_eps(eps)))

    def embed(self, table, token_dev, out) -> None:
        """out[H] = table[token_dev[0]] (an id outside [0, V) gives NaN, see embed.cu)."""
        d = self.dims
        ck.check_array("table", table, np.float16, (d.vocab, d.hidden), align=16)
        ck.check_array("token_dev", token_dev, np.int32, (1,))
        ck.check_array("out", out, np.float16, (d.hidden,), align=16)
        ck.launch(self._embed, -(-(d.hidden // 8) // 256), 256, (table, token_dev, out))
