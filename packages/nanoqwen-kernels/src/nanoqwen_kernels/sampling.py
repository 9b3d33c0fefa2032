"""Launchers for on-device token selection over a batch (cuda/sampling.cu): argmax, the full sampler,
advance.

Sampler state lives in device buffers, one row per row of the batch, so one captured decode graph
serves every mix of requests (greedy and sampled rows side by side):
    params  float32 [B, 5]  temperature, top_k, top_p, min_p, repetition_penalty (pack_params)
    rng     uint64  [B, 2]  seed, step (pack_rng; the kernel advances step once per draw)
    history uint8   [B, V]  1 where row b's sequence has seen the id (the caller fills it; the kernel
                            marks each drawn id)
A 1-D logits [V] is the batch of one. Rows are independent: a row's token depends only on its own
logits, parameters, step and history.
"""

from __future__ import annotations

import math

import numpy as np

from . import checks as ck
from .dims import ModelDims
from .errors import KernelError

ARG_THREADS = 256
ARG_BLOCKS_PER_ROW = 128  # nq_argmax's grid at B = 1: V/128 logits per block
ARG_TOTAL_BLOCKS = 512  # the argmax workspace's per-block slots, shared by the rows of one launch
MAX_ROWS = ARG_TOTAL_BLOCKS  # one block per row at least
SAMPLE_THREADS = 1024
CANDIDATES = 1024  # nq_sample's candidate cap (see sampling.cu)
PARAMS = 5  # floats per params row
ADVANCE_THREADS = 128


def argmax_blocks_per_row(rows: int) -> int:
    """Blocks per row of nq_argmax: 128 for one row (enough blocks to fill the GPU on one 152k row),
    fewer per row as the batch grows, keeping the grid within the workspace's 512 slots."""
    return max(1, min(ARG_BLOCKS_PER_ROW, ARG_TOTAL_BLOCKS // rows))


def pack_params(*, temperature, top_k, top_p, min_p, repetition_penalty) -> np.ndarray:
    """One row of `params` (float32 [5]), validated: each bad value is a KernelError naming it."""
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
    # top_k travels as a float: exact up to 2^24, far above any vocabulary
    return np.array([temperature, min(top_k, 2**24), top_p, min_p, repetition_penalty], np.float32)


def pack_rng(seed, step: int = 0) -> np.ndarray:
    """One row of `rng` (uint64 [2]): the seed (any int >= 0, taken mod 2^64) and the draw counter."""
    seed = ck.check_int("seed", seed, 0)
    step = ck.check_int("step", step, 0)
    return np.array([seed % 2**64, step % 2**64], dtype=np.uint64)


class SamplingKernels:
    def __init__(self, dims: ModelDims, load_module):
        self.dims = dims
        m = load_module(["sampling.cu"], dims.defines())
        self._argmax = m.get_function("nq_argmax")
        self._sample = m.get_function("nq_sample")
        self._advance = m.get_function("nq_advance")
        cupy = ck.cupy_module()
        # argmax workspace: per-block winners + one last-block ticket per row (kept at 0 between
        # launches). One per KernelSet: launches on two streams at once would share it (one decode stream).
        self._part_v = cupy.empty(ARG_TOTAL_BLOCKS, dtype=np.float32)
        self._part_i = cupy.empty(ARG_TOTAL_BLOCKS, dtype=np.int32)
        self._ticket = cupy.zeros(MAX_ROWS, dtype=np.uint32)

    def _logits(self, logits) -> tuple[int, int]:
        """(rows, n) of logits float32 [B, n] (or [n], B = 1)."""
        ck.check_array("logits", logits, np.float32)
        if logits.ndim not in (1, 2) or logits.size < 1:
            raise KernelError(f"logits must be [B, V] (or [V]) and non-empty, got shape {tuple(logits.shape)}")
        rows, n = (1, int(logits.shape[0])) if logits.ndim == 1 else (int(logits.shape[0]), int(logits.shape[1]))
        if n >= 2**31:
            raise KernelError("logits too long for int32 ids")
        if rows > MAX_ROWS:
            raise KernelError(f"logits has {rows} rows; at most {MAX_ROWS} per launch")
        return rows, n

    def argmax(self, logits, token_out) -> None:
        """token_out[b] = argmax(logits[b]) (lowest id on ties)."""
        rows, n = self._logits(logits)
        ck.check_array("token_out", token_out, np.int32, (rows,))
        ck.launch(
            self._argmax,
            (argmax_blocks_per_row(rows), rows, 1),
            ARG_THREADS,
            (logits, np.int32(n), self._part_v, self._part_i, self._ticket, token_out),
        )

    def make_sampler_state(self, rows: int = 1):
        """(params float32 [rows, 5], rng uint64 [rows, 2]) device buffers, zeroed (temperature 0 = greedy)."""
        rows = ck.check_int("rows", rows, 1, MAX_ROWS + 1)
        cupy = ck.cupy_module()
        return cupy.zeros((rows, PARAMS), dtype=np.float32), cupy.zeros((rows, 2), dtype=np.uint64)

    def set_sampler_params(self, params, rng, *, temperature, top_k, top_p, min_p, repetition_penalty, seed,
                           step: int = 0) -> None:
        """Write one request's parameters and seed into a one-row state (host->device copies; not inside a
        graph). A batch's rows are staged on the host with pack_params / pack_rng instead."""
        ck.check_array("params", params, np.float32, (1, PARAMS))
        ck.check_array("rng", rng, np.uint64, (1, 2))
        row = pack_params(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          repetition_penalty=repetition_penalty)
        r = pack_rng(seed, step)
        params.set(row[None, :])
        rng.set(r[None, :])

    def sample(self, logits, params, rng_state, history, token_out) -> None:
        """token_out[b] = a draw from row b's processed distribution (see sampling.cu), with row b's params,
        RNG stream and history; marks the drawn id in history[b] and advances rng_state[b]'s step."""
        rows, n = self._logits(logits)
        ck.check_array("params", params, np.float32, (rows, PARAMS))
        ck.check_array("rng_state", rng_state, np.uint64, (rows, 2))
        ck.check_array("history", history, np.uint8, (rows, n))
        ck.check_array("token_out", token_out, np.int32, (rows,))
        ck.launch(
            self._sample, rows, SAMPLE_THREADS, (logits, np.int32(n), params, rng_state, history, token_out)
        )

    def advance(self, pos_dev, seq_len_dev) -> None:
        """pos_dev[b] += 1 and seq_len_dev[b] += 1 on the device for every row with seq_len > 0 (a row of
        seq_len 0 is idle padding and stays so)."""
        ck.check_array("pos_dev", pos_dev, np.int32)
        if pos_dev.ndim != 1 or pos_dev.size < 1:
            raise KernelError(f"pos_dev must be int32 [B], got shape {tuple(pos_dev.shape)}")
        rows = int(pos_dev.size)
        ck.check_array("seq_len_dev", seq_len_dev, np.int32, (rows,))
        ck.check_distinct(pos_dev=pos_dev, seq_len_dev=seq_len_dev)
        ck.launch(self._advance, -(-rows // ADVANCE_THREADS), ADVANCE_THREADS,
                  (pos_dev, seq_len_dev, np.int32(rows)))
