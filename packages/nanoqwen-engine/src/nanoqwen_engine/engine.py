"""Engine: load a model, serve many requests at once through one engine thread.

  caller threads / asyncio                         engine thread (owns the backend, so the GPU)
  ------------------------------------             ------------------------------------------------
  submit(prompt, params)                           loop:
    encode, validate (raise here)                    run queued calls (score)
    waiting.append(Request) ---- lock + notify --->  schedule()   cancellations, preemption, admission
    -> RequestHandle                                 execute()    one batched decode + prefill chunks
  for ev in handle / async for ev in handle  <----   update       ids -> events -> handles
  handle.cancel() ------------ lock + notify --->    (freed at the next step boundary)

`generate`, `complete` and `score` are built on `submit`: a single request is a batch of one. The engine
thread starts with the first request and stops in `close()`; it is a daemon, so a program that forgets
close() still exits. The scheduling policy (chunked prefill, admission, preemption) is scheduler.py's.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np

from .argcheck import check_bool, check_int, is_int
from .backend import Backend
from .config import ModelConfig
from .errors import (
    EngineClosedError,
    InvalidRequestError,
    KVPagesExhaustedError,
    ModelFormatError,
    NanoqwenError,
    NoGPUError,
    PromptTooLongError,
    QueueFullError,
)
from .kv_pages import pages_for
from .lm_head import lm_head_dtype_arg
from .model_source import resolve_model
from .params import SamplingParams, check_generation_config
from .request import Completion, GenerationEvent, Request, RequestHandle
from .sampler import SamplerState
from .scheduler import Scheduler
from .tokenizer import Tokenizer

T = TypeVar("T")

DEFAULT_MAX_BATCH = 64
DEFAULT_PREFILL_CHUNK = 512
DEFAULT_MAX_QUEUE = 256


PREFILL_WEIGHTS = ("auto", "fp16", "int4", "fp8")  # cuda/plan.py's (kept here: the engine imports no CuPy)
DECODE_ACTIVATIONS = ("fp16", "int8")  # cuda/load.py's


class Engine:
    def __init__(self, backend: Backend, tokenizer: Tokenizer, nqfile, path, load_s: float,
                 max_batch: int = DEFAULT_MAX_BATCH, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 max_queue: int = DEFAULT_MAX_QUEUE, prefill_chunk_idle: int | None = None):
        _check_serving_args(max_batch, prefill_chunk, max_queue, prefill_chunk_idle)
        self.backend = backend
        self.tokenizer = tokenizer
        self.config: ModelConfig = backend.config
        self.generation_config: dict = dict(nqfile.generation_config or {})
        self.path = path
        self._file = nqfile  # keeps the mmap alive while backends hold views of it
        self.max_context = min(int(backend.max_context), backend.pool.max_tokens_per_seq)
        self.max_batch, self.prefill_chunk, self.max_queue = max_batch, prefill_chunk, max_queue
        if prefill_chunk_idle is None:  # the backend's choice (CudaBackend.PREFILL_CHUNK_IDLE), else no larger
            prefill_chunk_idle = getattr(backend, "PREFILL_CHUNK_IDLE", prefill_chunk)
        self._scheduler = Scheduler(backend, max_batch, prefill_chunk, prefill_chunk_idle)
        self.prefill_chunk_idle = self._scheduler.prefill_chunk_idle  # never below prefill_chunk
        self._info = {"model": str(path), "load_s": load_s, "max_context": self.max_context,
                      "max_batch": max_batch, "prefill_chunk": prefill_chunk,
                      "prefill_chunk_idle": self.prefill_chunk_idle, "max_queue": max_queue}
        self._cv = threading.Condition()  # guards the waiting queue, cancellations, calls, closing
        self._calls: list[tuple[Callable[[], Any], Future]] = []
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._closed_error: EngineClosedError | None = None

    @property
    def info(self) -> dict:
        """What the load took and what the backend reports; read live, because some figures (the decode
        graph's kernel-node count) exist only after the first decode step."""
        return {**self.backend.info, **self._info}

    @classmethod
    def load(cls, path_or_hf_id, device: str = "cuda", max_context: int | None = None, progress: bool = True,
             kv_pages: int | None = None, decode_mode: str = "graph", max_batch: int = DEFAULT_MAX_BATCH,
             prefill_chunk: int = DEFAULT_PREFILL_CHUNK, max_queue: int = DEFAULT_MAX_QUEUE,
             prefill_chunk_idle: int | None = None, prefill_weights: str | None = None,
             decode_activations: str | None = None, lm_head_dtype: str | None = None) -> Engine:
        """Open a .nanoqwen file (an HF folder or hub id is converted into the cache first).

        device: "cuda" (nanoqwen_engine.cuda.CudaBackend) or "cpu" (the numpy reference backend).
        max_context: tokens per sequence (default: the backend's choice). kv_pages: page-pool size.
        decode_mode: "graph" (CUDA graph replays) or "eager" (the same launches one by one, for
        debugging); the CPU backend has only one mode. max_batch: running sequences at most;
        prefill_chunk: prompt tokens prefilled per step at most while other requests decode (it bounds
        their stall); prefill_chunk_idle: per step when none decodes (a lone prompt's time to first
        token; at least prefill_chunk; None: the backend's, 8192 on the GPU, prefill_chunk on the CPU);
        max_queue: waiting requests at most. prefill_weights (GPU only): what prefill's GEMMs multiply,
        "auto" (default: $NANOQWEN_PREFILL_WEIGHTS, else a resident fp16 copy where it fits, else the INT4
        matrices as stored), "fp16", "int4", or "fp8" (opt-in: e4m3 activations on the FP8 tensor cores, a
        numerics change; docs/PERF.md). decode_activations (GPU only): what a single sequence's decode GEMVs
        multiply the INT4 weights with, "int8" (default: $NANOQWEN_DECODE_ACTIVATIONS, else int8 unless
        $NANOQWEN_GEMV_VARIANT names a variant: the activation rounded to int8 with one scale per 16 values,
        products by dp4a, like llama.cpp's q8_1 GEMVs; ~15% faster batch-1 decode on the 7B, and on the real
        1.5B the same agreement with transformers fp32 as fp16) or "fp16" (the activation as it is; a
        sequence then gets the same greedy tokens alone as in a batch); batches of 2 or more multiply fp16
        either way.
        lm_head_dtype (both devices, so the CPU reference multiplies what the GPU does): how the lm_head is
        stored and multiplied, "int8" (default: $NANOQWEN_LM_HEAD_DTYPE, else int8) or "fp16". At batch 1
        the lm_head is the largest single read of a decode step (7B: 1.09 GB of 4.46 GB); "int8" quantizes
        it once at load to int8 with one fp16 scale per 128 values, finer than the Q6_K llama.cpp's Q4_K_M
        files ship their output in: half the bytes, slightly different logits (the GPU's batch-1 GEMV
        multiplies s * q with fp32 sums, its larger batches and score() fp16(s * q), the CPU reference
        s * q in float32; nanoqwen_engine.lm_head). "fp16": the file's values as they are.
        Every argument is checked before the model is touched (InvalidRequestError). Format errors from
        nanoqwen_format are wrapped in ModelFormatError (original as __cause__); a config or
        generation_config value of the wrong type or range is a ConfigError (a ModelFormatError).
        """
        t0 = time.perf_counter()
        if device not in ("cuda", "cpu"):
            raise InvalidRequestError(f"device must be 'cuda' or 'cpu', got {device!r}")
        if decode_mode not in ("graph", "eager"):
            raise InvalidRequestError(f"decode_mode must be 'graph' or 'eager', got {decode_mode!r}")
        if device == "cpu" and decode_mode != "graph":
            raise InvalidRequestError("decode_mode='eager' applies to device='cuda' only (the CPU reference "
                                      "backend has no graphs)")
        if prefill_weights is not None and prefill_weights not in PREFILL_WEIGHTS:
            raise InvalidRequestError(f"prefill_weights must be one of {PREFILL_WEIGHTS}, got {prefill_weights!r}")
        if device == "cpu" and prefill_weights not in (None, "auto"):
            raise InvalidRequestError("prefill_weights applies to device='cuda' only (the CPU reference computes in "
                                      "float32)")
        if decode_activations is not None and decode_activations not in DECODE_ACTIVATIONS:
            raise InvalidRequestError(f"decode_activations must be one of {DECODE_ACTIVATIONS}, got "
                                      f"{decode_activations!r}")
        if device == "cpu" and decode_activations not in (None, "fp16"):
            raise InvalidRequestError("decode_activations applies to device='cuda' only (the CPU reference computes "
                                      "in float32)")
        head_dtype = lm_head_dtype_arg(lm_head_dtype)
        if max_context is not None:
            check_int("max_context", max_context, InvalidRequestError, lo=1)
        if kv_pages is not None:
            check_int("kv_pages", kv_pages, InvalidRequestError, lo=1)
        check_bool("progress", progress, InvalidRequestError)
        _check_serving_args(max_batch, prefill_chunk, max_queue, prefill_chunk_idle)
        path = resolve_model(path_or_hf_id, progress=progress)
        from nanoqwen_format import NanoqwenFormatError, open_model

        try:
            nq = open_model(path)
            config = ModelConfig.from_hf(nq.config, nq.generation_config)
            check_generation_config(nq.generation_config)
            tokenizer = Tokenizer(nq.tokenizer_json, nq.tokenizer_config)
        except NanoqwenFormatError as e:
            raise ModelFormatError(f"{path}: {e}") from e
        except ModelFormatError as e:  # ConfigError included: say which file
            raise type(e)(f"{path}: {e}") from e
        backend: Backend
        try:
            if device == "cpu":
                from .reference import ReferenceBackend

                backend = ReferenceBackend.create(nq, config, max_context=max_context, n_pages=kv_pages,
                                                  lm_head_dtype=head_dtype)
            else:
                extra: dict[str, object] = {"lm_head_dtype": head_dtype}
                if kv_pages is not None:
                    extra["n_pages"] = kv_pages
                if prefill_weights is not None:
                    extra["prefill_weights"] = prefill_weights
                if decode_activations is not None:
                    extra["decode_activations"] = decode_activations
                backend = cls._cuda_backend(nq, config, max_context, progress, {**extra, "decode_mode": decode_mode, "max_batch": max_batch})
        except NanoqwenFormatError as e:
            raise ModelFormatError(f"{path}: {e}") from e
        return cls(backend, tokenizer, nq, path, time.perf_counter() - t0, max_batch=max_batch,
                   prefill_chunk=prefill_chunk, max_queue=max_queue, prefill_chunk_idle=prefill_chunk_idle)

    @staticmethod
    def _cuda_backend(nq, config, max_context, progress, extra) -> Backend:
        try:
            from .cuda import CudaBackend
        except ImportError as e:  # CuPy (or the kernels package) missing: no GPU path on this install
            raise NoGPUError(f"the CUDA backend is not available: {e} (use device='cpu' for the reference "
                             "backend)") from e
        # create() checks the GPU first and raises NoGPUError / WrongGPUError with the reason.
        return CudaBackend.create(nq, config, max_context=max_context, progress=progress, **extra)

    # -- requests --

    def encode_prompt(self, prompt_or_messages) -> list[int]:
        """A str is raw text (special-token markup parsed); a list of token ids (ints) is taken as is; a
        list of messages ({"role", "content"} dicts) goes through the chat template."""
        p = prompt_or_messages
        if isinstance(p, str):
            ids = self.tokenizer.encode(p)
        elif isinstance(p, np.ndarray) or (isinstance(p, Sequence) and len(p) > 0 and is_int(p[0])):
            return token_ids_arg(p, self.config.vocab, "prompt").tolist()
        elif isinstance(p, Sequence):
            ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(p, add_generation_prompt=True))
        else:
            raise InvalidRequestError(f"prompt must be a str, a list of token ids or a list of messages, got "
                                      f"{type(p).__name__}")
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if max(ids) >= self.config.vocab:
            raise InvalidRequestError(f"prompt token id {max(ids)} is outside the model's vocabulary of {self.config.vocab}")
        return ids

    def submit(self, prompt_or_messages, params: SamplingParams | None = None) -> RequestHandle:
        """Queue a request; returns its handle at once. Thread-safe.

        prompt_or_messages: raw text, a list of token ids, or a list of chat messages (encode_prompt).

        Raises here, with nothing queued: InvalidRequestError (prompt, params), PromptTooLongError (the
        prompt exceeds the context), KVPagesExhaustedError (the request could never fit the whole page
        pool: its prompt + max_tokens - 1 tokens, capped at the context, need more pages than exist),
        QueueFullError (`max_queue` requests already wait), EngineClosedError.
        """
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = self.encode_prompt(prompt_or_messages)
        p = (params or SamplingParams()).resolve(self.generation_config)
        if len(ids) > self.max_context:
            raise PromptTooLongError(f"prompt is {len(ids)} tokens, the context holds {self.max_context}")
        worst = min(len(ids) + p.max_tokens - 1, self.max_context)  # type: ignore[operator]  # resolved
        pool = self.backend.pool
        if pages_for(worst) > pool.n_pages:
            raise KVPagesExhaustedError(
                f"KV cache too small for this request: prompt {len(ids)} + max_tokens {p.max_tokens} needs up "
                f"to {pages_for(worst)} pages of 16 tokens, the whole pool has {pool.n_pages} (lower max_tokens "
                f"or load with more kv_pages)")
        rid = next(self._ids)
        handle = RequestHandle(rid, len(ids), lambda: self._cancel(req))
        req = Request(rid, ids, p, SamplerState(p, self.config.vocab), self.tokenizer.stream(),
                      self.config.eos_ids, self.max_context, handle)
        with self._cv:
            self._check_open()
            if len(self._scheduler.waiting) >= self.max_queue:
                raise QueueFullError(f"{len(self._scheduler.waiting)} requests are waiting (max_queue "
                                     f"{self.max_queue}); retry later")
            self._scheduler.waiting.append(req)
            self._start()
            self._cv.notify_all()
        return handle

    def generate(self, prompt_or_messages, params: SamplingParams | None = None) -> Iterator[GenerationEvent]:
        """Yield one GenerationEvent per generated token; the last one carries finish_reason and stats.

        The request is submitted (and validated: errors raise here) at the call; closing the iterator
        before the end cancels it and returns once its pages are back in the pool.
        """
        return self._stream(self.submit(prompt_or_messages, params))

    @staticmethod
    def _stream(handle: RequestHandle) -> Iterator[GenerationEvent]:
        try:
            yield from handle
        finally:
            if not handle.done:
                handle.cancel()
                handle.wait()

    def complete(self, prompt_or_messages, params: SamplingParams | None = None) -> Completion:
        handle = self.submit(prompt_or_messages, params)
        try:
            return handle.result()
        except BaseException:  # KeyboardInterrupt while waiting included: the request must not linger
            handle.cancel()
            raise

    def score(self, token_ids) -> np.ndarray:
        """float32 [len, vocab]: row i is the logits after token_ids[:i+1], teacher-forced.

        token_ids: a 1-D sequence of Python or numpy integers in 0..vocab-1 (no floats, no nesting).
        Runs on the engine thread between steps, in a temporary sequence; KVPagesExhaustedError when the
        running requests leave too few free pages for it.
        """
        ids = token_ids_arg(token_ids, self.config.vocab, "score")
        if ids.size > self.max_context:
            raise PromptTooLongError(f"{ids.size} tokens to score, the context holds {self.max_context}")
        return self._call(lambda: self.backend.score(ids))

    # -- the engine thread --

    def _call(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread at the next step boundary; its result or exception here."""
        fut: Future = Future()
        with self._cv:
            self._check_open()
            self._calls.append((fn, fut))
            self._start()
            self._cv.notify_all()
        return fut.result()

    def _cancel(self, req: Request) -> None:
        with self._cv:
            if not req.finished:
                req.cancel_requested = True
                self._cv.notify_all()

    def _check_open(self) -> None:
        if self._closing:
            raise EngineClosedError("the engine is closed")

    def _start(self) -> None:
        """Start the engine thread if it is not running (caller holds _cv)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="nanoqwen-engine", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        sched = self._scheduler
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closing or self._calls or sched.has_work())
                if self._closing:
                    break
                calls, self._calls = self._calls, []
            for fn, fut in calls:
                try:
                    fut.set_result(fn())
                except BaseException as e:
                    fut.set_exception(e)
            try:
                with self._cv:
                    plan = sched.schedule()
                sched.execute(plan)
            except Exception as e:  # a bug in a step: fail what is in flight, keep serving
                with self._cv:
                    sched.fail_all(NanoqwenError(f"internal error in an engine step: {type(e).__name__}: {e}")
                                   .with_traceback(e.__traceback__))
        with self._cv:
            err = EngineClosedError("the engine was closed before this request finished")
            sched.fail_all(err)
            for _, fut in self._calls:
                fut.set_exception(err)
            self._calls = []

    def stats(self) -> dict:
        """A snapshot of the scheduler and the KV pool (any thread)."""
        s = self._scheduler
        pool = self.backend.pool
        with self._cv:
            c = s.counters
            return {
                "waiting": len(s.waiting), "running": len(s.running),
                "kv_pages_used": pool.n_used, "kv_pages_free": pool.n_free, "kv_pages_total": pool.n_pages,
                "steps": c.steps, "decode_rows": c.decode_rows, "prefill_tokens": c.prefill_tokens,
                "tokens_generated": c.tokens_generated, "preemptions": c.preemptions,
                "requests_finished": c.requests_finished, "requests_cancelled": c.requests_cancelled,
                "requests_failed": c.requests_failed, "max_batch": self.max_batch,
                "prefill_chunk": self.prefill_chunk, "prefill_chunk_idle": self.prefill_chunk_idle,
                "max_queue": self.max_queue,
                "closed": self._closing,
            }

    def close(self) -> None:
        """Stop the engine thread after its current step; requests still waiting or running end with
        EngineClosedError and their pages return to the pool. Idempotent; later submits raise
        EngineClosedError."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_serving_args(max_batch, prefill_chunk, max_queue, prefill_chunk_idle=None) -> None:
    check_int("max_batch", max_batch, InvalidRequestError, lo=1)
    check_int("prefill_chunk", prefill_chunk, InvalidRequestError, lo=1)
    if prefill_chunk_idle is not None:
        check_int("prefill_chunk_idle", prefill_chunk_idle, InvalidRequestError, lo=1)
    check_int("max_queue", max_queue, InvalidRequestError, lo=1)


def token_ids_arg(token_ids, vocab: int, what: str) -> np.ndarray:
    """int64 [T] from a non-empty 1-D sequence of Python or numpy integers in 0..vocab-1, or
    InvalidRequestError naming what is wrong (no float truncation, no flattening of nested lists)."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1:
            raise InvalidRequestError(f"{what} takes a 1-D sequence of token ids, got an array of shape {token_ids.shape}")
        if not np.issubdtype(token_ids.dtype, np.integer):
            raise InvalidRequestError(f"{what} takes integer token ids, got dtype {token_ids.dtype}")
        items = token_ids.tolist()
    elif isinstance(token_ids, Sequence) and not isinstance(token_ids, str | bytes):
        items = list(token_ids)
    else:
        raise InvalidRequestError(f"{what} takes a 1-D sequence of token ids, got {type(token_ids).__name__}")
    if not items:
        raise InvalidRequestError(f"{what} needs at least one token")
    for i, t in enumerate(items):
        if not is_int(t):
            raise InvalidRequestError(f"token ids must be integers, got {t!r} ({type(t).__name__}) at index {i}")
        if not 0 <= int(t) < vocab:
            raise InvalidRequestError(f"token ids must be in 0..{vocab - 1}, got {t} at index {i}")
    return np.asarray([int(t) for t in items], dtype=np.int64)


__all__ = ["Engine", "GenerationEvent", "Completion", "RequestHandle", "NanoqwenError"]
