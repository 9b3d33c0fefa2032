"""The sampler's device state, one row per row of the batched decode step (plus one for prefill), and
which kernel picks the next ids.

    params   f32   [R, 5]  temperature, top_k, top_p, min_p, repetition_penalty of the row's request
    rng      u64   [R, 2]  its seed and draw counter (the kernel advances the counter per draw)
    history  uint8 [R, V]  1 where the row's sequence has seen the id (the repetition-penalty set)
    R = max_batch + 1: rows 0..max_batch-1 are the decode rows, row max_batch the prefill's.

A row's state is uploaded when a sequence takes the row (rows.py) and then lives on the device: the
kernel marks each id it draws and advances the counter, as the host's SamplerState observes the same
ids. The draw counter of a row is the position of the token being drawn (prefill of a sequence of n
tokens draws the token at position n; a decode step feeding position p draws p + 1), so a sequence's
random stream is the same whichever rows and batches it ran in.

Two modes, one captured graph each per batch bucket (the mode decides which kernel is in the graph;
everything a request can change lives in the buffers above):
  "greedy"  every row is temperature 0 without repetition penalty: the batched argmax, a small kernel.
  "sample"  any other mix: nq_sample, one block per row, each row with its own parameters. A greedy row
            in it is the argmax of its (penalised) logits, so greedy and sampled requests share a step.
The history of a row is uploaded only when its request has a repetition penalty: no other step reads it.
"""

from __future__ import annotations

import numpy as np
from nanoqwen_kernels.sampling import pack_params, pack_rng

from ..sampler import SamplerState

GREEDY, SAMPLE = "greedy", "sample"


def mode_of(params) -> str:
    """Which kernel a request's rows need."""
    if params.temperature == 0 and params.repetition_penalty == 1.0:
        return GREEDY
    return SAMPLE


def batch_mode(samplers) -> str:
    """One mode for a step: greedy only when every row is."""
    return GREEDY if all(mode_of(s.params) == GREEDY for s in samplers) else SAMPLE


class DeviceSampler:
    def __init__(self, dev, ks, vocab: int, max_batch: int):
        self.dev, self.vocab = dev, vocab
        self.prefill_row = max_batch
        rows = max_batch + 1
        self.params, self.rng = ks.make_sampler_state(rows)  # f32 [R, 5], u64 [R, 2]
        # every row starts as a valid greedy request: idle rows of a "sample" step run with it
        greedy = pack_params(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
        dev.h2d(self.params, np.tile(greedy, (rows, 1)))
        self.history = dev.xp.zeros((rows, vocab), dtype=np.uint8)  # uint8 [R, V]
        self._one = np.ones(1, dtype=np.uint8)

    @property
    def nbytes(self) -> int:
        return int(self.history.nbytes) + int(self.params.nbytes) + int(self.rng.nbytes)

    def load(self, row: int, sampler: SamplerState, step: int) -> None:
        """Upload one request's parameters, seed (draw counter at `step`) and, when it has a repetition
        penalty, its seen-ids mask into `row`."""
        p = sampler.params
        dev = self.dev
        dev.h2d(self.params[row:row + 1], pack_params(
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
            repetition_penalty=p.repetition_penalty)[None, :])
        dev.h2d(self.rng[row:row + 1], pack_rng(sampler.seed, step)[None, :])
        if p.repetition_penalty != 1.0:
            dev.h2d(self.history[row:row + 1], sampler.seen.astype(np.uint8)[None, :])

    def mark(self, row: int, token: int) -> None:
        """Add one id fed from the host (not drawn on the device) to the row's seen-ids mask."""
        self.dev.h2d(self.history[row, token:token + 1], self._one)

    def launch(self, ks, mode: str, logits, token_out, lo: int, hi: int) -> None:
        """Pick token_out[b] from logits[b] for the rows lo..hi-1 of the state (logits/token_out have
        hi - lo rows)."""
        if mode == GREEDY:
            ks.argmax(logits, token_out)
        else:
            ks.sample(logits, self.params[lo:hi], self.rng[lo:hi], self.history[lo:hi], token_out)
