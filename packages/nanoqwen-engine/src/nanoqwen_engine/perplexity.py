"""Perplexity of a model on a token stream, as llama.cpp's llama-perplexity measures it, with one choice
stated here because results depend on it.

The stream is cut into non-overlapping windows of `window` tokens (the last window may be shorter; it
counts if it has at least 2 tokens). Each window is scored from an empty context with `engine.score`:
the logits after token i predict token i+1, so a window of W tokens gives W-1 predictions, and its first
token is context only, never predicted (nothing precedes it in the window). Every prediction counts,
also those near the window's start with little context; llama.cpp instead scores only the second half
of each window, which gives lower numbers on the same text: compare like with like.

    nll_t = logsumexp(z_t) - z_t[target]      (z_t the float32 logits widened to float64)
    ppl   = exp(sum of nll_t over all windows / number of predictions)

The log-softmax is computed in float64 in row blocks, so a 1024 x 152k window never needs a float64
copy of all its logits at once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .errors import InvalidRequestError

ROW_BLOCK = 128  # logit rows widened to float64 at a time (128 x 152k x 8 B = 156 MB)


@dataclass
class PerplexityResult:
    ppl: float  # exp(nll_mean)
    nll_mean: float  # mean negative log-likelihood per scored token, in nats
    tokens_scored: int  # predictions: the sum over windows of (window length - 1)
    windows: int
    window: int  # the window length asked for
    seconds: float  # time spent scoring (tokenization and model load not included)
    window_nll: list[float] = field(default_factory=list)  # mean nll of each window, in order
    token_nll: np.ndarray = field(default_factory=lambda: np.zeros(0))  # float64 [tokens_scored]

    @property
    def nll_stderr(self) -> float:
        """Standard error of nll_mean over tokens (treats tokens as independent: a lower bound)."""
        n = self.token_nll.size
        return float(self.token_nll.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")

    def as_dict(self) -> dict:
        return {"ppl": self.ppl, "nll_mean": self.nll_mean, "nll_stderr": self.nll_stderr,
                "tokens_scored": self.tokens_scored, "windows": self.windows, "window": self.window,
                "time_s": self.seconds, "window_nll": self.window_nll}


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits[t])[targets[t]] in float64, for logits [T, V] and int targets [T]."""
    targets = np.asarray(targets, dtype=np.int64)
    out = np.empty(len(targets), dtype=np.float64)
    for a in range(0, len(targets), ROW_BLOCK):
        z = np.asarray(logits[a : a + ROW_BLOCK], dtype=np.float64)  # [b, V]
        m = z.max(axis=1)
        lse = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
        out[a : a + ROW_BLOCK] = lse - z[np.arange(len(z)), targets[a : a + ROW_BLOCK]]
    return out


def split_windows(n_tokens: int, window: int, max_windows: int | None = None) -> list[tuple[int, int]]:
    """[start, stop) of each window: non-overlapping, a short tail kept if it has >= 2 tokens."""
    bounds = [(a, min(a + window, n_tokens)) for a in range(0, n_tokens, window)]
    bounds = [(a, b) for a, b in bounds if b - a >= 2]
    return bounds[:max_windows] if max_windows is not None else bounds


def check_window(engine, window: int) -> None:
    """InvalidRequestError unless 2 <= window <= what the engine (and the model) can hold."""
    if window < 2:
        raise InvalidRequestError(f"window must be at least 2 tokens (one to predict from, one to predict), "
                                  f"got {window}")
    limit = min(engine.max_context, engine.config.max_position)
    if window > limit:
        raise InvalidRequestError(f"window of {window} tokens exceeds the context of {limit} tokens "
                                  f"(engine max_context {engine.max_context}, model max_position_embeddings "
                                  f"{engine.config.max_position})")


def perplexity(engine, token_ids: Sequence[int], window: int = 1024, max_windows: int | None = None,
               progress: Callable[[int, float], None] | None = None) -> PerplexityResult:
    """Perplexity of `engine` on `token_ids` (module doc). progress(tokens_scored_in_window, running_ppl) is
    called after each window."""
    check_window(engine, window)
    if max_windows is not None and max_windows < 1:
        raise InvalidRequestError(f"max_windows must be >= 1, got {max_windows}")
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    if ids.size < 2:
        raise InvalidRequestError(f"the text is {ids.size} token(s); perplexity needs at least 2")
    bounds = split_windows(ids.size, window, max_windows)
    t0 = time.perf_counter()
    parts, window_nll = [], []
    total = 0.0
    count = 0
    for a, b in bounds:
        logits = engine.score(ids[a:b])  # float32 [b-a, V]; row i predicts ids[a+i+1]
        nll = token_nll(logits[:-1], ids[a + 1 : b])
        parts.append(nll)
        window_nll.append(float(nll.mean()))
        total += float(nll.sum())
        count += nll.size
        if progress is not None:
            progress(nll.size, math.exp(total / count))
    all_nll = np.concatenate(parts)
    nll_mean = float(all_nll.mean())
    return PerplexityResult(ppl=math.exp(nll_mean), nll_mean=nll_mean, tokens_scored=int(all_nll.size),
                            windows=len(bounds), window=window, seconds=time.perf_counter() - t0,
                            window_nll=window_nll, token_nll=all_nll)


def planned_tokens(n_tokens: int, window: int, max_windows: int | None = None) -> int:
    """How many predictions perplexity() will score (a progress bar's total)."""
    return sum(b - a - 1 for a, b in split_windows(n_tokens, window, max_windows))
