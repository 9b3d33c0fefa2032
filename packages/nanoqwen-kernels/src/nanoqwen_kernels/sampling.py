"""Launchers for on-device token selection (cuda/sampling.cu): argmax, the full sampler, advance.

Sampler state lives in device buffers so one captured decode graph serves every request:
    params  float32 [5]  temperature, top_k, top_p, min_p, repetition_penalty
    rng     uint64  [2]  seed, step (the kernel advances step)
    history uint8   [V]  1 where the sequence has seen the id (the caller fills it; the kernel marks
                         each drawn id)
"""

from __future__ import annotations

import math

import numpy as np

from . import checks as ck
from .dims import ModelDims
from .errors import KernelError

ARG_BLOCKS = 128  # nq_argmax's kArgBlocks
ARG_THREADS = 256
SAMPLE_THREADS = 1024
CANDIDATES = 1024  # nq_sample's candidate cap (see sampling.cu)


class SamplingKernels:
    def __init__(self, dims: ModelDims, load_module):
        self.dims = dims
        m = load_module(["sampling.cu"], dims.defines())
        self._argmax = m.get_function("nq_argmax")
        self._sample = m.get_function("nq_sample")
        self._advance = m.get_function("nq_advance")
        cupy = ck.cupy_module()
        # argmax workspace: per-block winners + the last-block ticket (kept at 0 between launches).
        # One per KernelSet: launches on two streams at once would share it (one decode stream here).
        self._part_v = cupy.empty(ARG_BLOCKS, dtype=np.float32)
        self._part_i = cupy.empty(ARG_BLOCKS, dtype=np.int32)
        self._ticket = cupy.zeros(1, dtype=np.uint32)

    def _logits(self, logits) -> int:
        ck.check_array("logits", logits, np.float32)
        if logits.ndim != 1 or logits.size < 1:
            raise KernelError(f"logits must be 1-D and non-empty, got shape {tuple(logits.shape)}")
        if logits.size >= 2**31:
            raise KernelError("logits too long for int32 ids")
        return int(logits.size)

    def argmax(self, logits, token_out) -> None:
        """token_out[0] = argmax(logits) (lowest id on ties)."""
        n = self._logits(logits)
        ck.check_array("token_out", token_out, np.int32, (1,))
        ck.launch(
            self._argmax,
            ARG_BLOCKS,
            ARG_THREADS,
            (logits, np.int32(n), self._part_v, self._part_i, self._ticket, token_out),
        )

    def make_sampler_state(self):
        """(params float32 [5], rng uint64 [2]) device buffers, zeroed (temperature 0 = greedy)."""
        cupy = ck.cupy_module()
        return cupy.zeros(5, dtype=np.float32), cupy.zeros(2, dtype=np.uint64)

    def set_sampler_params(
        self, params, rng, *, temperature, top_k, top_p, min_p, repetition_penalty, seed
    ) -> None:
        """Write one request's parameters and seed (a host->device copy; not for inside a graph)."""
        ck.check_array("params", params, np.float32, (5,))
        ck.check_array("rng", rng, np.uint64, (2,))
        vals = dict(temperature=temperature, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty)
        for name, v in vals.items():
            if isinstance(v, bool) or not isinstance(v, int | float | np.number) or not math.isfinite(v):
                raise KernelError(f"{name} must be a finite number, got {v!r}")
        if temperature < 0:
            raise KernelError(f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise KernelError(f"top_p must be in (0, 1], got {top_p}")
        if not 0 <= min_p <= 1:
            raise KernelError(f"min_p must be in [0, 1], got {min_p}")
        if repetition_penalty <= 0:
            raise KernelError(f"repetition_penalty must be > 0, got {repetition_penalty}")
        top_k = ck.check_int("top_k", top_k, 0)
        seed = ck.check_int("seed", seed, 0)
        params.set(np.array([temperature, min(top_k, 2**24), top_p, min_p, repetition_penalty], np.float32))
        rng.set(np.array([seed % 2**64, 0], dtype=np.uint64))

    def sample(self, logits, params, rng_state, history, token_out) -> None:
        """token_out[0] = a draw from the processed distribution (see sampling.cu); marks it in history."""
        n = self._logits(logits)
        ck.check_array("params", params, np.float32, (5,))
        ck.check_array("rng_state", rng_state, np.uint64, (2,))
        ck.check_array("history", history, np.uint8, (n,))
        ck.check_array("token_out", token_out, np.int32, (1,))
        ck.launch(
            self._sample, 1, SAMPLE_THREADS, (logits, np.int32(n), params, rng_state, history, token_out)
        )

    def advance(self, pos_dev, seq_len_dev) -> None:
        """pos_dev[0] += 1 and seq_len_dev[0] += 1 on the device."""
        ck.check_array("pos_dev", pos_dev, np.int32, (1,))
        ck.check_array("seq_len_dev", seq_len_dev, np.int32, (1,))
        ck.launch(self._advance, 1, 1, (pos_dev, seq_len_dev))
