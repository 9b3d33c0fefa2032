"""Launcher for the embedding lookup (cuda/embed.cu): B token ids from device memory -> B rows."""

from __future__ import annotations

import numpy as np

from . import checks as ck
from .dims import ModelDims


class EmbedKernels:
    def __init__(self, dims: ModelDims, load_module):
        self.dims = dims
        self._embed = load_module(["embed.cu"], dims.defines()).get_function("nq_embed")

    def embed(self, table, token_dev, out) -> None:
        """out[B, H] = table[token_dev[b]] (a 1-D out is B = 1); an id outside [0, V) gives a NaN row."""
        d = self.dims
        ck.check_array("table", table, np.float16, (d.vocab, d.hidden), align=16)
        ck.check_array("out", out, np.float16, align=16)
        b = ck.batch_rows("out", out, d.hidden)
        ck.check_array("token_dev", token_dev, np.int32, (b,))
        ck.launch(self._embed, (-(-(d.hidden // 8) // 256), b), 256, (table, token_dev, out))
