"""The scheduler: which sequences run in the next step, and what happens when the KV pool runs dry.

The loop has the shape of vLLM v1's engine core, one iteration per step:

    schedule()  (under the engine's lock; waiting is shared with submitting threads)
      1. drop cancelled requests (waiting or running): pages freed, last event "cancelled"
      2. reserve this step's decode pages: every running request that has finished its prompt feeds one
         token; if the pages those rows need exceed the free pages, PREEMPT the most recently admitted
         running request and try again
      3. prefill budget `prefill_chunk` tokens (`prefill_chunk_idle` when no row decodes this step: nobody's
         next token waits behind the prefill then, and a long prompt's time to first token is shortest in
         few large passes): running requests still prefilling take the next chunk of their prompt, in
         admission order
      4. admit from the head of the waiting queue (FIFO, no overtaking) while the budget lasts, fewer than
         `max_batch` run, and the pages of the request's WHOLE prompt can be had beside step 2's reserve;
         those pages are allocated at admission, so a prompt is never caught half-prefilled by a dry pool
    execute(plan)  (no lock)
      one batched backend.decode(seqs, ids, samplers, run_ahead) for all decode rows (run_ahead when
      the next step will most likely be the same rows: _steady), then one backend.prefill_many of every
      prefill chunk (seq, chunk, sampler or None; the sampler only with a prompt's last chunk, whose
      logits give the first token); if that call fails, each chunk alone, so a failure ends only the
      request it belongs to
    update
      each sampled id goes through the request's detokenizer and stop logic and out as an event; a
      finished request's pages go back to the pool at once

Pool exhaustion policy: preempt by recompute. The victim (most recently admitted, as in vLLM) loses its
pages and goes back to the HEAD of the waiting queue, keeping everything else: its generated tokens,
its sampler (seen-token set and RNG stream), its detokenizer and stop state. When re-admitted, its prompt
and all its generated tokens but the last are prefilled again (no sampling: those tokens are already
out), then it decodes on from its last token; nothing is emitted twice and a seeded request draws the
same random stream as it would have without the interruption. Waiting instead (a running request that
cannot grow simply sits out steps) would hold pages that nobody uses and can deadlock when every running
request needs a page; recompute always frees pages, and it keeps the oldest request moving.

Why nothing livelocks: Engine.submit refuses a request whose worst case (prompt + max_tokens - 1 cached
tokens, capped by the context) needs more pages than the whole pool, so any request alone fits. The
oldest running request is never the victim while a younger one runs, so it always progresses and ends;
then the next oldest does.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .backend import Backend
from .errors import NanoqwenError
from .kv_pages import SequenceState, pages_for
from .request import Request


@dataclass
class StepPlan:
    decode: list[Request] = field(default_factory=list)  # rows of the batched decode, in running order
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens this step)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


@dataclass
class Counters:
    steps: int = 0
    decode_rows: int = 0  # sum of batch sizes over the decode calls
    prefill_tokens: int = 0
    tokens_generated: int = 0
    preemptions: int = 0
    requests_finished: int = 0  # ended normally: stop, length, context
    requests_cancelled: int = 0
    requests_failed: int = 0


class Scheduler:
    """Owns the waiting queue and the running set. `schedule` must be called under the lock that guards
    `waiting` (Engine's); `execute` runs on the engine thread alone. `step()` does both, for callers that
    drive the scheduler directly from one thread (tests)."""

    def __init__(self, backend: Backend, max_batch: int, prefill_chunk: int, prefill_chunk_idle: int | None = None):
        """prefill_chunk: prompt tokens per step beside decoding rows (it bounds their stall: a 512-token
        chunk of the 7B takes ~11 ms on the H200); prefill_chunk_idle: per step when no row decodes
        (default prefill_chunk; never below it)."""
        self.backend = backend
        self.pool = backend.pool
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.prefill_chunk_idle = max(prefill_chunk, prefill_chunk_idle or prefill_chunk)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: running[-1] is the preemption victim
        self.counters = Counters()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- schedule --

    def schedule(self) -> StepPlan:
        self._drop_cancelled()
        while True:
            decode = [r for r in self.running if r.decoding]
            need = sum(_pages_to_grow(r) for r in decode)
            if need <= self.pool.n_free:
                break
            self._preempt(self.running[-1])
        plan = StepPlan(decode=decode)
        budget = self.prefill_chunk if decode else self.prefill_chunk_idle
        for r in self.running:
            if budget > 0 and not r.decoding:
                n = min(r.prefill_remaining, budget)
                plan.prefill.append((r, n))
                budget -= n
        free = self.pool.n_free - need
        while self.waiting and budget > 0 and len(self.running) < self.max_batch:
            r = self.waiting[0]
            pages = pages_for(r.prefill_target)
            if pages > free:
                break  # head-of-line: the queue waits for pages rather than letting later requests overtake
            self.waiting.popleft()
            r.seq = self.pool.new_sequence()
            self.pool.grow(r.seq, r.prefill_target)
            free -= pages
            if r.t_admit is None:
                r.t_admit = time.perf_counter()
            self.running.append(r)
            n = min(r.prefill_target, budget)
            plan.prefill.append((r, n))
            budget -= n
        return plan

    def _drop_cancelled(self) -> None:
        for r in [r for r in self.waiting if r.cancel_requested]:
            self.waiting.remove(r)
            self._end(r, cancelled=True)
        for r in [r for r in self.running if r.cancel_requested]:
            self._end(r, cancelled=True)

    def _preempt(self, r: Request) -> None:
        assert r.seq is not None
        self.pool.free(r.seq)
        r.seq = None
        self.running.remove(r)
        self.waiting.appendleft(r)
        r.preemptions += 1
        self.counters.preemptions += 1

    # -- execute + update --

    def execute(self, plan: StepPlan) -> None:
        if not plan:
            return
        self.counters.steps += 1
        if plan.decode:
            rows = plan.decode
            try:
                toks = self.backend.decode([_seq(r) for r in rows], [r.output[-1] for r in rows],
                                           [r.sampler for r in rows], run_ahead=self._steady(plan))
            except Exception as e:  # the batch is one call: every row shares its failure
                for r in rows:
                    self._end(r, error=e)
            else:
                self.counters.decode_rows += len(rows)
                for r, tok in zip(rows, toks, strict=True):
                    self._token(r, tok)
        items = []
        for r, n in plan.prefill:
            if r.finished or r.seq is None:
                continue
            sample = r.seq.length + n == r.prefill_target and not r.output  # the prompt's last chunk
            items.append((r, n, (_seq(r), np.asarray(r.prefill_ids(n), dtype=np.int32),
                                 r.sampler if sample else None)))
        if not items:
            return
        firsts: list[object] = []
        before = [it[0].length for _, _, it in items]
        try:  # one call: the chunks of this step share the backend's GEMMs
            firsts = list(self.backend.prefill_many([it for _, _, it in items]))
        except Exception as batch_error:  # find which one fails: each alone (its K/V written again)
            firsts = []
            for (r, _, it), length in zip(items, before, strict=True):
                try:
                    if it[0].length != length:  # the failed call took this one's tokens: not again
                        raise batch_error
                    firsts.append(self.backend.prefill(*it))
                except Exception as e:
                    self._end(r, error=e)
                    firsts.append(_FAILED)
        for (r, n, _), first in zip(items, firsts, strict=True):
            if first is _FAILED:
                continue
            self.counters.prefill_tokens += n
            if first is not None:
                self._token(r, int(first))  # type: ignore[call-overload]  # an id: not None, not _FAILED

    def _steady(self, plan: StepPlan) -> bool:
        """Whether the next step will most likely decode exactly this step's rows again (the backend may
        then run that step ahead: Backend.decode's run_ahead). Not when this step prefills (a prompt that
        completes joins the decode rows), when a waiting request could be admitted next, or when a row's
        token of this step is its last by max_tokens or the context. A row that stops on an end token or
        a stop string, or is cancelled, cannot be foreseen: that step is then discarded."""
        if plan.prefill or (self.waiting and len(self.running) < self.max_batch):
            return False
        return all(len(r.output) + 1 < r.params.max_tokens  # type: ignore[operator]  # resolved params
                   and _seq(r).length + 1 < r.max_context for r in plan.decode)

    def step(self) -> StepPlan:
        plan = self.schedule()
        self.execute(plan)
        return plan

    # Bookkeeping (pages, counters) always comes before delivering a request's last event: a caller
    # woken by it (complete() returning) must find the pool and stats() already updated.

    def _token(self, r: Request, tok: int) -> None:
        self.counters.tokens_generated += 1
        event = r.on_token(int(tok))
        if event.finish_reason is not None:
            self._release(r)
            self.counters.requests_finished += 1
        r.deliver(event)

    def _end(self, r: Request, cancelled: bool = False, error: BaseException | None = None) -> None:
        """A request ends other than by its own tokens: cancelled, or failed with `error`."""
        self._release(r)
        if cancelled:
            self.counters.requests_cancelled += 1
            r.deliver(r.on_cancel())
        else:
            self.counters.requests_failed += 1
            r.fail(error if error is not None else NanoqwenError("request ended"))

    def _release(self, r: Request) -> None:
        if r.seq is not None:
            self.pool.free(r.seq)
            r.seq = None
        if r in self.running:
            self.running.remove(r)

    def fail_all(self, error: BaseException) -> None:
        """End every waiting and running request with `error` (engine shutdown, or a bug in a step)."""
        while self.waiting:
            self._end(self.waiting.popleft(), error=error)
        for r in list(self.running):
            self._end(r, error=error)


_FAILED = object()  # a prefill chunk whose request ended with its error


def _seq(r: Request) -> SequenceState:
    """The sequence of a running request (admitted requests always have one)."""
    assert r.seq is not None, f"request {r.request_id} is not admitted"
    return r.seq


def _pages_to_grow(r: Request) -> int:
    """Pages a decoding request needs beyond its own for its next token."""
    seq = _seq(r)
    return pages_for(seq.length + 1) - seq.n_pages
