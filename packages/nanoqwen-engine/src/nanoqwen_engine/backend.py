"""The contracts between the engine and its backends, as typing.Protocols (docs/INTERFACES.md section 6).

The CPU reference backend (reference/backend.py) and the CUDA backend (cuda/backend.py) both satisfy
`Backend`; the engine and the scheduler are written against this protocol only, and the lint session's
type checker holds them to it. Batch 1 is the case B = 1 of `decode`: there is no single-sequence path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from .config import ModelConfig
from .kv_pages import PagePool, SequenceState
from .sampler import SamplerState


class Backend(Protocol):
    config: ModelConfig  # dims, eps, theta, eos ids, vocab, tie flag
    pool: PagePool  # the KV page allocator; the backend owns the cache arrays it indexes
    max_context: int  # tokens per sequence the backend was built for
    info: dict[str, Any]  # device, load_s, weights_bytes, kv_bytes, workspace_bytes, ...

    def prefill(self, seq: SequenceState, token_ids: np.ndarray, sampler: SamplerState | None) -> int | None:
        """Write the K/V of token_ids at positions seq.length.. (a whole prompt or one chunk of it:
        chunked and whole prefill give the same K/V and logits). Grows seq first (all-or-nothing:
        KVPagesExhaustedError / PromptTooLongError with nothing changed) and raises seq.length after.
        Returns the next id sampled from the last position's logits when `sampler` is given (the
        prompt's last chunk), else None."""
        ...

    def prefill_many(self, items: Sequence[tuple[SequenceState, np.ndarray, SamplerState | None]]
                     ) -> list[int | None]:
        """prefill(seq, token_ids, sampler) of each item (distinct sequences), as one call: what each
        returns, in order. A backend may run them as one pass (the CUDA backend shares every GEMM across
        the items' rows); the K/V and ids are those of the separate calls. Grows every sequence first,
        all-or-nothing across the items."""
        ...

    def decode(self, seqs: Sequence[SequenceState], token_ids: Sequence[int],
               samplers: Sequence[SamplerState], run_ahead: bool = False) -> list[int]:
        """One batched step: row b feeds token_ids[b] at position seqs[b].length of seqs[b] and samples
        with samplers[b] (its own params, seed and history). Grows every sequence by one token first,
        all-or-nothing across the batch. Returns the B sampled ids.

        run_ahead is a hint: the caller expects to call next with the same sequences, fed the ids
        returned now. A backend may start that step before returning (the CUDA backend does, to hide
        its host work behind the device's); any other next call must still be served exactly, as if
        the hint had not been given. The results never depend on it."""
        ...

    def score(self, token_ids: np.ndarray) -> np.ndarray:
        """float32 [T, V]: the logits after each prefix, teacher-forced, in a temporary sequence."""
        ...

    def last_logits(self) -> np.ndarray:
        """float32 [B, V] of the last decode step, [1, V] after a prefill (debugging, the ladder)."""
        ...
