"""Engine: load a model, turn prompts into token streams.

  prompt / messages --chat template, tokenizer--> ids --backend.prefill--> first id
     --(stop checks, detokenizer)--> event --backend.decode--> next id --> ... --> finish_reason

One request at a time per Engine. Each request takes a sequence from the backend's page pool and gives it
back when it ends: normally, on an error, or when the caller stops iterating (generator close), so the
engine stays usable after any failed request.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .config import ModelConfig
from .errors import (
    InvalidRequestError,
    ModelFormatError,
    NanoqwenError,
    NoGPUError,
    PromptTooLongError,
)
from .model_source import resolve_model
from .params import SamplingParams
from .sampler import SamplerState
from .stops import StopStrings
from .tokenizer import Tokenizer


@dataclass
class GenerationEvent:
    token_id: int  # the token just generated
    text: str  # text completed by it ('' while a character or a possible stop string is held back)
    finish_reason: str | None = None  # None until the last event: "stop", "length" or "context"
    stats: dict | None = None  # on the last event only: the request's numbers (see Completion.stats)


@dataclass
class Completion:
    text: str
    token_ids: list[int]  # every generated id, the eos id included when one ended the request
    finish_reason: str
    prompt_tokens: int
    # prompt_tokens, generated_tokens, prefill_s (prompt -> first token), decode_s (time inside the
    # generated_tokens - 1 decode steps, not counting the caller's time between events), seed
    stats: dict = field(default_factory=dict)


class Engine:
    def __init__(self, backend, tokenizer: Tokenizer, nqfile, path, load_s: float):
        self.backend = backend
        self.tokenizer = tokenizer
        self.config: ModelConfig = backend.config
        self.generation_config: dict = dict(nqfile.generation_config or {})
        self.path = path
        self._file = nqfile  # keeps the mmap alive while backends hold views of it
        ctx = getattr(backend, "max_context", None) or backend.pool.max_tokens_per_seq
        self.max_context = min(int(ctx), backend.pool.max_tokens_per_seq)
        self._info = {"model": str(path), "load_s": load_s, "max_context": self.max_context}

    @property
    def info(self) -> dict:
        """What the load took and what the backend reports; read live, because some figures (the decode
        graph's kernel-node count) exist only after the first decode step."""
        return {**getattr(self.backend, "info", {}), **self._info}

    @classmethod
    def load(cls, path_or_hf_id, device: str = "cuda", max_context: int | None = None, progress: bool = True,
             kv_pages: int | None = None, decode_mode: str = "graph") -> Engine:
        """Open a .nanoqwen file (an HF folder or hub id is converted into the cache first).

        device: "cuda" (nanoqwen_engine.cuda.CudaBackend) or "cpu" (the numpy reference backend).
        max_context: tokens per sequence (default: the backend's choice). kv_pages: page-pool size.
        decode_mode: "graph" (one CUDA graph replay per token) or "eager" (the same launches one by one,
        for debugging and the seed's eager-vs-graph comparison); the CPU backend has only one mode.
        Format errors from nanoqwen_format are wrapped in ModelFormatError (original as __cause__).
        """
        t0 = time.perf_counter()
        if device not in ("cuda", "cpu"):
            raise InvalidRequestError(f"device must be 'cuda' or 'cpu', got {device!r}")
        if decode_mode not in ("graph", "eager"):
            raise InvalidRequestError(f"decode_mode must be 'graph' or 'eager', got {decode_mode!r}")
        if device == "cpu" and decode_mode != "graph":
            raise InvalidRequestError("decode_mode='eager' applies to device='cuda' only (the CPU reference "
                                      "backend has no graphs)")
        if max_context is not None and max_context < 1:
            raise InvalidRequestError(f"max_context must be >= 1, got {max_context}")
        path = resolve_model(path_or_hf_id, progress=progress)
        from nanoqwen_format import NanoqwenFormatError, open_model

        try:
            nq = open_model(path)
            config = ModelConfig.from_hf(nq.config, nq.generation_config)
            tokenizer = Tokenizer(nq.tokenizer_json, nq.tokenizer_config)
        except NanoqwenFormatError as e:
            raise ModelFormatError(f"{path}: {e}") from e
        extra = {"n_pages": kv_pages} if kv_pages is not None else {}
        try:
            if device == "cpu":
                from .reference import ReferenceBackend

                backend = ReferenceBackend.create(nq, config, max_context=max_context, **extra)
            else:
                backend = cls._cuda_backend(nq, config, max_context, progress, {**extra, "decode_mode": decode_mode})
        except NanoqwenFormatError as e:
            raise ModelFormatError(f"{path}: {e}") from e
        return cls(backend, tokenizer, nq, path, time.perf_counter() - t0)

    @staticmethod
    def _cuda_backend(nq, config, max_context, progress, extra):
        try:
            from .cuda import CudaBackend
        except ImportError as e:  # CuPy (or the kernels package) missing: no GPU path on this install
            raise NoGPUError(f"the CUDA backend is not available: {e} (use device='cpu' for the reference "
                             "backend)") from e
        # create() checks the GPU first and raises NoGPUError / WrongGPUError with the reason.
        return CudaBackend.create(nq, config, max_context=max_context, progress=progress, **extra)

    # -- requests --

    def encode_prompt(self, prompt_or_messages) -> list[int]:
        """A str is raw text (special-token markup parsed); a list of messages goes through the template."""
        if isinstance(prompt_or_messages, str):
            text = prompt_or_messages
        elif isinstance(prompt_or_messages, Sequence):
            text = self.tokenizer.apply_chat_template(prompt_or_messages, add_generation_prompt=True)
        else:
            raise InvalidRequestError(f"prompt must be a str or a list of messages, got {type(prompt_or_messages).__name__}")
        ids = self.tokenizer.encode(text)
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if max(ids) >= self.config.vocab:
            raise InvalidRequestError(f"prompt token id {max(ids)} is outside the model's vocabulary of {self.config.vocab}")
        return ids

    def generate(self, prompt_or_messages, params: SamplingParams | None = None) -> Iterator[GenerationEvent]:
        """Yield one GenerationEvent per generated token; the last one carries finish_reason and stats.

        Validation (prompt, params, length) happens here, before the first event is requested, so a bad
        request raises at the call, not later inside a loop.
        """
        ids = self.encode_prompt(prompt_or_messages)
        p = (params or SamplingParams()).resolve(self.generation_config)
        if len(ids) > self.max_context:
            raise PromptTooLongError(f"prompt is {len(ids)} tokens, the context holds {self.max_context}")
        return self._run(ids, p)

    def _run(self, ids: list[int], p: SamplingParams) -> Iterator[GenerationEvent]:
        pool = self.backend.pool
        sampler = SamplerState(p, self.config.vocab)
        eos = set() if p.ignore_eos else set(self.config.eos_ids)
        stream = self.tokenizer.stream()
        stops = StopStrings(p.stop)
        seq = pool.new_sequence()
        n_gen = 0
        decode_s = 0.0
        t0 = time.perf_counter()
        try:
            tok = self.backend.prefill(seq, np.asarray(ids, dtype=np.int32), sampler)
            prefill_s = time.perf_counter() - t0
            while True:
                n_gen += 1
                finish = None
                if tok in eos:
                    finish, delta = "stop", stops.flush() + stream.flush()
                else:
                    delta = stops.push(stream.push(tok))
                    if stops.stopped:
                        finish = "stop"
                    elif n_gen >= p.max_tokens:
                        finish = "length"
                    elif seq.length >= self.max_context:
                        finish = "context"
                    if finish and not stops.stopped:
                        delta += stops.flush() + stream.flush()
                if finish:
                    stats = {"prompt_tokens": len(ids), "generated_tokens": n_gen, "prefill_s": prefill_s,
                             "decode_s": decode_s, "seed": sampler.seed}
                    yield GenerationEvent(tok, delta, finish, stats)
                    return
                yield GenerationEvent(tok, delta)
                t = time.perf_counter()
                tok = self.backend.decode(seq, tok, sampler)
                decode_s += time.perf_counter() - t
        finally:
            pool.free(seq)

    def complete(self, prompt_or_messages, params: SamplingParams | None = None) -> Completion:
        ids, parts, last = [], [], None
        gen = self.generate(prompt_or_messages, params)
        for ev in gen:
            ids.append(ev.token_id)
            parts.append(ev.text)
            last = ev
        stats = last.stats
        return Completion("".join(parts), ids, last.finish_reason, stats["prompt_tokens"], stats)

    def score(self, token_ids) -> np.ndarray:
        """float32 [len, vocab]: row i is the logits after token_ids[:i+1], teacher-forced."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise InvalidRequestError("score needs at least one token")
        if ids.min() < 0 or ids.max() >= self.config.vocab:
            raise InvalidRequestError(f"token ids must be in 0..{self.config.vocab - 1}")
        if ids.size > self.max_context:
            raise PromptTooLongError(f"{ids.size} tokens to score, the context holds {self.max_context}")
        return self.backend.score(ids)


__all__ = ["Engine", "GenerationEvent", "Completion", "NanoqwenError"]
