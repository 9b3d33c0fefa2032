"""Sampling in numpy, with transformers' semantics (the CPU backend's sampler, and the GPU's reference).

The pipeline, in transformers' order (LogitsProcessorList of `generate`):

  logits --repetition penalty--> --temperature--> --top-k--> --top-p--> --min-p--> softmax --draw--> id

- repetition penalty (RepetitionPenaltyLogitsProcessor): for every token id already seen in the sequence
  (prompt and generated), a logit `x` becomes `x / penalty` if `x > 0`, else `x * penalty`; so
  penalty > 1 always makes a seen token less likely. Ids seen several times are penalised once.
- temperature (TemperatureLogitsWarper): logits / temperature. temperature == 0 means greedy: the
  argmax of the (penalised) logits, the lowest id on ties (numpy argmax), no draw.
- top-k (TopKLogitsWarper): logits below the k-th largest become -inf (ties with the k-th are kept).
- top-p (TopPLogitsWarper): sort ascending, cumulative softmax probabilities; a token is removed when
  the cumulative sum up to and including it is <= 1 - top_p; the most likely token always stays.
- min-p (MinPLogitsWarper): with p = softmax(logits), tokens with p < min_p * max(p) are removed.
- the draw: inverse CDF with one uniform from a numpy Generator seeded per request, so a seed gives the
  same tokens on every run.
"""

from __future__ import annotations

import secrets
from typing import TypeVar

import numpy as np

from .params import SamplingParams

T = TypeVar("T")


def apply_repetition_penalty(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """logits float32 [V], seen bool [V] -> penalised copy (see module doc)."""
    out = logits.copy()
    if penalty == 1.0:
        return out
    x = out[seen]
    out[seen] = np.where(x > 0, x / penalty, x * penalty)
    return out


def top_k_mask(logits: np.ndarray, k: int) -> np.ndarray:
    """Copy with logits below the k-th largest set to -inf; k == 0 or k >= V leaves all."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits.copy()
    kth = np.partition(logits, -k)[-k]
    return np.where(logits < kth, -np.inf, logits).astype(logits.dtype)


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = np.max(x)
    e = np.exp(x - m)
    return e / e.sum()


def top_p_mask(logits: np.ndarray, p: float) -> np.ndarray:
    """Copy with the low tail removed as transformers' TopPLogitsWarper does (see module doc)."""
    if p >= 1.0:
        return logits.copy()
    order = np.argsort(logits, kind="stable")  # ascending, as transformers sorts
    cum = np.cumsum(_softmax(logits[order]))
    remove_sorted = cum <= 1.0 - p
    remove_sorted[-1] = False  # min_tokens_to_keep = 1
    out = logits.copy()
    out[order[remove_sorted]] = -np.inf
    return out


def min_p_mask(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Copy with tokens of probability < min_p * max probability set to -inf."""
    if min_p <= 0.0:
        return logits.copy()
    probs = _softmax(logits)
    out = logits.copy()
    remove = probs < min_p * probs.max()
    remove[np.argmax(probs)] = False
    out[remove] = -np.inf
    return out


def _resolved(v: T | None, name: str) -> T:
    if v is None:
        raise ValueError(f"SamplingParams.{name} is unresolved (call params.resolve first)")
    return v


def processed_logits(logits: np.ndarray, params: SamplingParams, seen: np.ndarray) -> np.ndarray:
    """The logits after every processor, before softmax (for tests and the GPU comparison)."""
    x = apply_repetition_penalty(np.asarray(logits, dtype=np.float32), seen,
                                 _resolved(params.repetition_penalty, "repetition_penalty"))
    temperature = _resolved(params.temperature, "temperature")
    if temperature == 0:
        return x
    x = x / np.float32(temperature)
    x = top_k_mask(x, _resolved(params.top_k, "top_k"))
    x = top_p_mask(x, _resolved(params.top_p, "top_p"))
    return min_p_mask(x, _resolved(params.min_p, "min_p"))


class SamplerState:
    """One request's sampler: resolved params, the seeded Generator, the seen-token mask.

    Backends call `observe(ids)` for every token fed into the sequence (prompt and generated; idempotent)
    and `sample(logits)` to pick the next id, which is then observed too.
    """

    def __init__(self, params: SamplingParams, vocab: int):
        if params.temperature is None:
            raise ValueError("SamplerState needs resolved SamplingParams (call params.resolve first)")
        self.params = params
        self.vocab = vocab
        self.seen = np.zeros(vocab, dtype=bool)  # bool [V]: ids in the sequence so far
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    def observe(self, token_ids) -> None:
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        self.seen[ids[(ids >= 0) & (ids < self.vocab)]] = True

    def sample(self, logits: np.ndarray) -> int:
        """logits float32 [V] (the model's raw output) -> next token id."""
        x = processed_logits(logits[: self.vocab], self.params, self.seen)
        if self.params.temperature == 0:
            tok = int(np.argmax(x))
        else:
            probs = _softmax(x)
            cdf = np.cumsum(probs)
            # u in [0, cdf[-1]); the first i with cdf[i] > u has cdf[i-1] <= u < cdf[i], so probs[i] > 0:
            # a masked (zero-probability) id is never drawn.
            u = self.rng.random() * cdf[-1]
            tok = int(np.searchsorted(cdf, u, side="right"))
        self.seen[tok] = True
        return tok
