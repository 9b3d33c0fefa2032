"""One request's two halves: the caller's RequestHandle (any thread, or an asyncio loop) and the engine
thread's Request (tokens, sampler, detokenizer, stop logic, its KV sequence).

The engine thread is the only writer of a Request; it hands events to the handle, whose small lock is
the only thing the two sides share:

  engine thread:  Request.on_token(id) -> GenerationEvent -> Request.deliver -> handle._push
                                                               |  deque + Condition (threads)
                                                               |  loop.call_soon_threadsafe (asyncio)
  caller:         for ev in handle / async for ev in handle <--+   handle.result() -> Completion

A handle's events are consumed once, by one consumer (one `for` or one `async for`); `result()` does not
consume them and may be called as well, from any thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .kv_pages import SequenceState
from .params import SamplingParams
from .sampler import SamplerState
from .stops import StopStrings
from .tokenizer import StreamDecoder

NO_TOKEN = -1  # token_id of a "cancelled" last event: it carries no new token


@dataclass
class GenerationEvent:
    token_id: int  # the token just generated (NO_TOKEN on a "cancelled" last event)
    text: str  # text completed by it ('' while a character or a possible stop string is held back)
    finish_reason: str | None = None  # None until the last event: "stop", "length", "context", "cancelled"
    stats: dict | None = None  # on the last event only: the request's numbers (see Completion.stats)


@dataclass
class Completion:
    text: str
    token_ids: list[int]  # every generated id, the eos id included when one ended the request
    finish_reason: str
    prompt_tokens: int
    # prompt_tokens, generated_tokens, queue_s (submit -> admitted), prefill_s (admitted -> first
    # token), decode_s (first token -> last token, the engine's time, not the caller's), ttft_s (submit
    # -> first token), preemptions, seed
    stats: dict = field(default_factory=dict)


class RequestHandle:
    """The caller's side of one submitted request: iterate it (blocking) or `async for` it for
    GenerationEvents; `result()` waits for the Completion; `cancel()` ends it at the next step boundary.

    An error inside the engine reaches the consumer as the exception it was, after the events that came
    before it; `result()` raises it too.
    """

    def __init__(self, request_id: int, prompt_tokens: int, cancel: Callable[[], None]):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._cancel = cancel
        self._cv = threading.Condition()
        self._items: deque[GenerationEvent | BaseException] = deque()
        self._done = False  # the last event (or an error) has been pushed
        self._exhausted = False  # ... and the consumer has taken it
        self._completion: Completion | None = None
        self._error: BaseException | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    # -- the engine thread's side --

    def _push(self, item: GenerationEvent | BaseException, completion: Completion | None = None) -> None:
        with self._cv:
            if self._done:
                return
            self._items.append(item)
            if isinstance(item, BaseException):
                self._error, self._done = item, True
            elif item.finish_reason is not None:
                self._completion, self._done = completion, True
            self._cv.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_wake, fut)
            except RuntimeError:  # that loop is closed: nobody is waiting there any more
                pass

    # -- the caller's side --

    @property
    def done(self) -> bool:
        """True once the request has ended (its last event or error is pushed; maybe not yet consumed)."""
        return self._done

    def cancel(self) -> None:
        """End the request: at the next step boundary its pages are freed and a last event with
        finish_reason "cancelled" is pushed. Idempotent; a no-op once the request has ended."""
        if not self._done:
            self._cancel()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request has ended; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._done, timeout)

    def result(self, timeout: float | None = None) -> Completion:
        """The whole Completion once the request ends (raises its error if it failed)."""
        if not self.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._completion is not None
        return self._completion

    def _take(self) -> GenerationEvent | BaseException | None:
        """The next item if one is buffered (caller holds _cv); None if none yet."""
        if self._items:
            item = self._items.popleft()
            if isinstance(item, BaseException) or item.finish_reason is not None:
                self._exhausted = True
            return item
        return None

    def __iter__(self) -> RequestHandle:
        return self

    def __next__(self) -> GenerationEvent:
        with self._cv:
            self._cv.wait_for(lambda: self._items or self._exhausted)
            if self._exhausted and not self._items:
                raise StopIteration
            item = self._take()
        if isinstance(item, BaseException):
            raise item
        assert item is not None
        return item

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> GenerationEvent:
        """Never blocks the loop: when nothing is buffered it awaits a future that the engine thread
        completes through loop.call_soon_threadsafe."""
        loop = asyncio.get_running_loop()
        while True:
            with self._cv:
                if self._exhausted and not self._items:
                    raise StopAsyncIteration
                item = self._take()
                if item is None:
                    fut = loop.create_future()
                    self._waiters.append((loop, fut))
            if item is None:
                await fut
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def __repr__(self) -> str:
        return f"RequestHandle(id={self.request_id}, prompt_tokens={self.prompt_tokens}, done={self._done})"


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class Request:
    """The engine thread's state of one request. Its token stream is prompt + output; the KV cache
    (`seq`) holds the first `seq.length` of them. A decode row feeds output[-1], so a request is ready
    to decode when the cache holds all but that last token (`decoding`). After a preemption `seq` is
    None and the cache must be rebuilt: prompt + output[:-1] are prefilled again (nothing re-emitted)."""

    def __init__(self, request_id: int, prompt: list[int], params: SamplingParams, sampler: SamplerState,
                 stream: StreamDecoder, eos_ids: tuple[int, ...], max_context: int, handle: RequestHandle):
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.sampler = sampler
        sampler.observe(prompt)  # the repetition-penalty set holds the whole prompt from the start
        self.stream = stream
        self.stops = StopStrings(params.stop)
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_ids)
        self.max_context = max_context
        self.handle = handle
        self.output: list[int] = []
        self.text_parts: list[str] = []
        self.seq: SequenceState | None = None
        self._completion: Completion | None = None
        self.cancel_requested = False  # set by any thread under the engine's lock
        self.finished = False
        self.preemptions = 0
        self.t_submit = time.perf_counter()
        self.t_admit: float | None = None
        self.t_first: float | None = None

    # -- where the request stands --

    @property
    def prefill_target(self) -> int:
        """Tokens the cache must hold before this request can decode (or, fresh, sample its first id)."""
        return len(self.prompt) + max(len(self.output) - 1, 0)

    @property
    def prefill_remaining(self) -> int:
        return self.prefill_target - (self.seq.length if self.seq is not None else 0)

    @property
    def decoding(self) -> bool:
        return self.seq is not None and bool(self.output) and self.seq.length == self.prefill_target

    def prefill_ids(self, n: int) -> list[int]:
        """The next n tokens to prefill (prompt, then the generated ones again after a preemption)."""
        assert self.seq is not None
        start = self.seq.length
        return (self.prompt + self.output)[start : start + n]

    # -- results --

    def on_token(self, tok: int) -> GenerationEvent:
        """Record a sampled id and build its event (not yet delivered: the scheduler frees a finished
        request's pages first, so a caller woken by the last event finds them back in the pool)."""
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
        self.output.append(tok)
        finish = None
        if tok in self.eos:
            finish, delta = "stop", self.stops.flush() + self.stream.flush()
        else:
            delta = self.stops.push(self.stream.push(tok))
            if self.stops.stopped:
                finish = "stop"
            elif len(self.output) >= self.params.max_tokens:  # type: ignore[operator]  # resolved params
                finish = "length"
            elif self.seq is not None and self.seq.length >= self.max_context:
                finish = "context"
            if finish and not self.stops.stopped:
                delta += self.stops.flush() + self.stream.flush()
        return self._event(tok, delta, finish)

    def on_cancel(self) -> GenerationEvent:
        """Last event of a cancelled request: whatever text was held back, no new token."""
        return self._event(NO_TOKEN, self.stops.flush() + self.stream.flush(), "cancelled")

    def deliver(self, event: GenerationEvent) -> None:
        self.handle._push(event, self._completion if event.finish_reason is not None else None)

    def fail(self, exc: BaseException) -> None:
        self.finished = True
        self.handle._push(exc)

    def _event(self, tok: int, delta: str, finish: str | None) -> GenerationEvent:
        self.text_parts.append(delta)
        if finish is None:
            return GenerationEvent(tok, delta)
        self.finished = True
        stats = self.stats()
        self._completion = Completion("".join(self.text_parts), list(self.output), finish, len(self.prompt), stats)
        return GenerationEvent(tok, delta, finish, stats)

    def stats(self) -> dict[str, Any]:
        now = time.perf_counter()
        t_admit = self.t_admit if self.t_admit is not None else now
        t_first = self.t_first if self.t_first is not None else now
        return {
            "prompt_tokens": len(self.prompt),
            "generated_tokens": len(self.output),
            "queue_s": t_admit - self.t_submit,
            "prefill_s": t_first - t_admit,
            "decode_s": now - t_first,
            "ttft_s": t_first - self.t_submit,
            "preemptions": self.preemptions,
            "seed": self.sampler.seed,
        }
