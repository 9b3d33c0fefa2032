"""The sampler's device state: which kernel picks the next id, and the buffers it reads.

Two modes, one captured graph each (the mode decides which kernel is in the graph; everything else a
request can change lives in device buffers, so one graph per mode serves every request):
  "greedy"  argmax of the logits (temperature 0 and no repetition penalty): one small kernel.
  "sample"  the full pipeline of the engine's numpy sampler (repetition penalty over a device presence
            mask of seen ids, temperature, top-k, top-p, min-p, a counter-based device RNG), the same
            semantics as nanoqwen_engine.sampler; the kernel marks the id it picks as seen.

    history  uint8 [V]  1 where the active sequence has seen the id (uploaded at prefill / switch)
    params   the kernel set's packed parameter buffer (temperature, top_k, top_p, min_p, penalty, seed)
    rng      the kernel set's RNG state (seed + step counter advanced on the device)
"""

from __future__ import annotations

import numpy as np


def mode_of(params) -> str:
    """Which graph a request uses."""
    if params.temperature == 0 and params.repetition_penalty == 1.0:
        return "greedy"
    return "sample"


class DeviceSampler:
    def __init__(self, dev, ks, vocab: int):
        self.dev, self.ks, self.vocab = dev, ks, vocab
        xp = dev.xp
        self.history = xp.zeros(vocab, dtype=np.uint8)  # uint8 [V]
        make = getattr(ks, "make_sampler_state", None)
        # params / rng buffers come from the kernel set (their layout is the kernel's business)
        self.params, self.rng = make() if make is not None else (None, None)
        self.owner = None  # (seq_id, request id) whose history/params are on the device

    @property
    def nbytes(self) -> int:
        n = int(self.history.nbytes)
        for b in (self.params, self.rng):
            n += int(getattr(b, "nbytes", 0))
        return n

    def load(self, owner, sampler) -> None:
        """Upload one request's history, params and seed (prefill, or switching sequences)."""
        if self.owner == owner:
            return
        self.dev.h2d(self.history, sampler.seen.astype(np.uint8))
        p = sampler.params
        set_params = getattr(self.ks, "set_sampler_params", None)
        if set_params is not None:
            set_params(self.params, self.rng, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                       min_p=p.min_p, repetition_penalty=p.repetition_penalty, seed=sampler.seed)
        self.owner = owner

    def invalidate(self) -> None:
        self.owner = None

    def launch(self, ks, mode: str, logits, token_out) -> None:
        if mode == "greedy":
            ks.argmax(logits, token_out)
        else:
            ks.sample(logits, self.params, self.rng, self.history, token_out)
