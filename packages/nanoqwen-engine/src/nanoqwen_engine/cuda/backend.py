"""CudaBackend: the batched Backend protocol (docs/INTERFACES.md section 6) on an sm_90 GPU.

    create:  the model onto the GPU (load.py: kernels, weights, the int8 lm_head, prefill's weight
             copy, the KV pool) -> the decode step's buffers for max_batch
    prefill: a prompt, or one chunk of it starting at seq.length, through the GEMM path (prefill.py);
             when a sampler is given, the last row -> lm_head -> the on-device sampler (its prefill row)
    decode:  one batched step of B sequences: rows assigned (rows.py), ctrl written where it changed,
             one CUDA graph replay for the batch's bucket (decode.py); the host reads back B ids
    score:   teacher-forced logits of every position, in a temporary sequence

Failures are NanoqwenError subclasses: NoGPUError / WrongGPUError (no usable GPU), GPUOutOfMemoryError
(load or request), KVPagesExhaustedError / PromptTooLongError (from the shared PagePool, raised before
any GPU work; a decode step grows all its sequences or none), InvalidRequestError (bad ids, a malformed
batch). After a failed request the device state this file caches (ctrl, the sampler rows) is marked
stale, so the next step uploads it again and the loaded model stays usable.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Sequence

import numpy as np

from ..config import ModelConfig
from ..errors import (
    InvalidRequestError,
    KVPagesExhaustedError,
    PromptTooLongError,
)
from ..kv_pages import PAGE_TOKENS, PagePool, SequenceState
from ..sampler import SamplerState
from .decode import DecodeStep
from .errors import GPUOutOfMemoryError
from .load import load
from .prefill import PrefillPass
from .rows import RowAssignment
from .sampling import GREEDY, DeviceSampler, batch_mode, mode_of
from .weights import DenseLayer, Fp8Layer, GpuWeights

# Steps in flight with run_ahead: 2 (a call queues the step after its own before waiting for its ids), or
# 1 (the step after is launched once the ids are read: the device idles for the host's wake-up, read and
# launch, 60-150 us a step on the H200, docs/PERF.md "eighteenth lease"). $NANOQWEN_RUN_AHEAD_DEPTH picks
# (an A/B knob).
RUN_AHEAD_DEPTH = 2


def run_ahead_depth() -> int:
    """RUN_AHEAD_DEPTH, or $NANOQWEN_RUN_AHEAD_DEPTH (1 or 2)."""
    raw = os.environ.get("NANOQWEN_RUN_AHEAD_DEPTH", "")
    if not raw:
        return RUN_AHEAD_DEPTH
    if raw not in ("1", "2"):
        raise InvalidRequestError(f"NANOQWEN_RUN_AHEAD_DEPTH={raw!r}: expected 1 or 2")
    return int(raw)


class CudaBackend:
    # Prompt tokens per scheduler step when no request is decoding (Engine's prefill_chunk_idle default): a
    # lone long prompt goes in passes of this many rows instead of prefill_chunk's 512. H200, 7B, 32,768
    # prompt tokens in passes of 512 / 2,048 / 4,096 / 8,192 / 16,384 rows: 1,442 / 1,283 / 1,245 / 1,222 /
    # 1,226 ms; 8,192 tokens: 325 / 211 / 218 / 207 / 207 ms (scripts/prefill_breakdown.py, docs/PERF.md
    # "twelfth lease"): attention over a 512-row pass fills 224 blocks, under one wave of the 264 slots.
    # The CPU reference backend has none (its steps stay at prefill_chunk: no speed to gain, memory to lose).
    PREFILL_CHUNK_IDLE = 8192

    def __init__(self, dev, ks, weights: GpuWeights, config: ModelConfig, pool: PagePool, k_cache, v_cache,
                 decode_mode: str, max_batch: int, info: dict, dense: list[DenseLayer] | None = None,
                 fp8: list[Fp8Layer] | None = None):
        self.dev, self.ks, self.w, self.config, self.pool = dev, ks, weights, config, pool
        self.k_cache, self.v_cache = k_cache, v_cache  # f16 [L, n_pages + 1, n_kv, 16, 128] each
        self.decode_mode = decode_mode
        self.max_batch = max_batch
        self.max_context = pool.max_tokens_per_seq
        xp, P = dev.xp, pool.max_pages_per_seq
        self.sampler_dev = DeviceSampler(dev, ks, config.vocab, max_batch)
        # the page after the pool's: written by idle rows, owned by no sequence (decode.py)
        self.step = DecodeStep(dev, ks, weights, config, k_cache, v_cache, P, max_batch, self.sampler_dev,
                               scratch_page=pool.n_pages)
        self.rows = RowAssignment(max_batch)
        # prefill graphs per bucket only in graph mode ("eager" is the debugging mode: every launch from
        # Python); $NANOQWEN_PREFILL_GRAPHS=0 turns them off alone (A/B runs)
        graphs = decode_mode == "graph" and os.environ.get("NANOQWEN_PREFILL_GRAPHS", "1") != "0"
        self.prefill_pass = PrefillPass(dev, ks, weights, config, k_cache, v_cache, dense, graphs=graphs, fp8=fp8)
        # prefill's own page tables and head buffers (a row per sequence of a prefill_many), so a prefill
        # leaves the decode rows' state alone
        self.pf_tables = xp.full((max_batch, P), -1, dtype=np.int32)  # int32 [max_batch, P]
        self.pf_table = self.pf_tables[0]  # score()'s
        self.pf_xn = xp.zeros((max_batch, config.hidden), dtype=np.float16)
        self.pf_logits = xp.zeros((max_batch, config.vocab), dtype=np.float32)
        self.pf_token = xp.zeros(max_batch, dtype=np.int32)
        self._last: tuple = ()  # what last_logits() reads: ("prefill", n) or ("decode", bucket, rows)
        # steps launched before their calls (decode's run_ahead), oldest first: at most RUN_AHEAD_DEPTH
        self._ahead: deque[_Ahead] = deque()
        self._depth = run_ahead_depth()
        self.info = info
        self.info["max_batch"] = max_batch
        self.info["workspace_bytes"] = self.step.workspace_bytes
        self.info["launcher_calls_per_token"] = self.step.count_launcher_calls()

    # ------------------------------------------------------------------ load
    @classmethod
    def create(cls, nqfile, config, max_context: int | None = None, progress: bool = True,
               **kwargs) -> CudaBackend:
        """Load nqfile (an open NanoqwenFile) onto the GPU (load.py), then the backend over it.

        kwargs: decode_mode "graph" (default) or "eager"; n_pages (pool size, overriding the sizing from
        max_context / free memory); max_batch (decode rows, default 64); prefill_weights "auto" (default:
        $NANOQWEN_PREFILL_WEIGHTS, else auto), "fp16", "int4" or "fp8" (opt-in: e4m3 activations;
        plan.choose_prefill_weights); decode_activations "int8" (default: $NANOQWEN_DECODE_ACTIVATIONS, else
        int8: batch-1 decode GEMVs on the int8-activation loop, the kernels' GEMV variant "a8"; a `kernels`
        stand-in must have been built for it) or "fp16" (load.decode_activations_plan says who decides); lm_head_dtype "int8" (default:
        $NANOQWEN_LM_HEAD_DTYPE, else int8: the lm_head quantized at load, one fp16 scale per 128 values,
        nanoqwen_engine.lm_head) or "fp16" (the file's values). Test hooks: `device` (a HostDevice) and
        `kernels` (a KernelSet stand-in) replace the GPU and the compiled kernels.
        """
        t_all = time.perf_counter()
        ld = load(nqfile, config, max_context, progress, **kwargs)
        with ld.dev.use():  # buffers zeroed on the backend's stream, ordered before its first launch
            be = cls(ld.dev, ld.ks, ld.weights, config, ld.pool, ld.k_cache, ld.v_cache, ld.decode_mode,
                     ld.max_batch, ld.info, ld.dense, ld.fp8)
        ld.dev.synchronize()
        ld.info["load_s"] = time.perf_counter() - t_all
        return be

    # ------------------------------------------------------------------ protocol
    def prefill(self, seq: SequenceState, token_ids: np.ndarray, sampler: SamplerState | None) -> int | None:
        """K/V of token_ids at positions seq.length.. (a prompt, or one chunk of it); the next id sampled
        from the last position when `sampler` is given, else None."""
        return self.prefill_many([(seq, token_ids, sampler)])[0]

    def prefill_many(self, items: Sequence[tuple[SequenceState, np.ndarray, SamplerState | None]]
                     ) -> list[int | None]:
        """prefill() of several sequences in one pass (Backend.prefill_many): their rows share every GEMM
        and so the dequantization of each weight, the larger cost of a short prompt (prefill.py). Every
        sequence grows first, all of them or none; a sampled item's id is drawn from its last row."""
        checked = []
        for seq, token_ids, sampler in items:
            checked.append((seq, self._check_ids(token_ids), sampler))
        if len({seq.seq_id for seq, _, _ in checked}) != len(checked):
            raise InvalidRequestError("prefill_many got the same sequence twice")
        if len(checked) > self.max_batch:
            raise InvalidRequestError(f"prefill_many takes at most max_batch = {self.max_batch} sequences, "
                                      f"got {len(checked)}")
        if not checked:
            return []
        self._settle_ahead()  # a step run ahead is for the decode rows as they were
        # raises before any GPU work; the pool and every seq unchanged then
        self.pool.grow_many([(seq, seq.length + int(ids.shape[0])) for seq, ids, _ in checked])
        for seq, _, _ in checked:  # a sequence's decode row (if it had one) no longer describes it
            self.rows.release(seq.seq_id)
        sampled = [k for k, (_, _, sm) in enumerate(checked) if sm is not None]
        toks: list[int | None] = [None] * len(checked)
        with self._guard(), self.dev.use():
            segs = []
            for k, (seq, ids, _) in enumerate(checked):
                self.dev.h2d(self.pf_tables[k], seq.page_table)
                segs.append((ids, seq.length, self.pf_tables[k]))
            x = self.prefill_pass.hidden_many(segs)
            if sampled:
                n = len(sampled)
                ends = np.cumsum([int(ids.shape[0]) for _, ids, _ in checked]) - 1
                rows = self.dev.xp.empty(n, dtype=np.int32)
                self.dev.h2d(rows, ends[sampled].astype(np.int32))
                last = x[rows]  # f16 [n, H]: each sampled sequence's last row
                self.step.launch_head(self.ks, last, self.pf_xn[:n], self.pf_logits[:n])
                row = self.sampler_dev.prefill_row
                for j, k in enumerate(sampled):  # one sampler row serves them in turn (stream order)
                    seq, ids, sm = checked[k]
                    assert sm is not None
                    sm.observe(ids)
                    # the draw counter is the drawn token's position (sampling.py)
                    self.sampler_dev.load(row, sm, step=seq.length + int(ids.shape[0]))
                    self.sampler_dev.launch(self.ks, mode_of(sm.params), self.pf_logits[j:j + 1],
                                            self.pf_token[j:j + 1], row, row + 1)
                out = self.dev.d2h(self.pf_token[:n])
                for j, k in enumerate(sampled):
                    toks[k] = int(out[j])
                self._last = ("prefill", n)
            else:
                self.dev.synchronize()  # a chunk's failure surfaces here, inside the guard
        for (seq, ids, sm), tok in zip(checked, toks, strict=True):
            seq.length += int(ids.shape[0])
            if sm is not None:
                sm.observe([tok])
        return toks

    def decode(self, seqs: Sequence[SequenceState], token_ids: Sequence[int],
               samplers: Sequence[SamplerState], run_ahead: bool = False) -> list[int]:
        """One batched step: row b feeds token_ids[b] at position seqs[b].length and samples with
        samplers[b]. Every sequence grows by one token first, all of them or none.

        Host work per step is kept to a few vectorised operations and one pass over the rows (it adds
        to every token's latency: the step is launched and waited for): a steady batch re-sends nothing
        (decode.py) and re-observes nothing (a fed token the device itself drew is already in both the
        host's and the device's seen-ids sets).

        run_ahead: the caller expects its next call to feed these same sequences the ids returned now.
        The step after this one is then launched before returning (when it can be: see _may_run_ahead),
        so the host's work between two calls overlaps the device's next step instead of idling it
        (H200, 7B: ~0.2 ms of host work per step at batch 1, ~0.4 ms at 32; docs/PERF.md). And when this
        call's own step already runs (launched ahead by the previous call), the step after it is queued
        before this call waits for its ids: two steps in flight, so the device does not idle while the
        host wakes, reads the ids and launches again either (60-150 us a step on the H200 with one step
        in flight: docs/PERF.md "eighteenth lease"). A next call that differs (a sequence left or
        joined, another id fed) discards the steps ahead: greedy rows only, so they consumed no random
        draw, and their K/V writes sit at positions past each sequence's length, which nothing reads
        until a real step writes them again."""
        toks_in = self._check_batch(seqs, token_ids, samplers)
        if not toks_in:
            self._settle_ahead()
            return []
        mode = batch_mode(samplers)
        if self._ahead and self._ahead[0].serves(seqs, toks_in, mode, self.rows):
            # the step was enqueued by the previous call: only its ids are left to read. Queue the one
            # after it first (fed on the device with the ids this one draws, one position further), so
            # the device has it in hand when this one ends
            rows, bucket = self._ahead[0].rows, self._ahead[0].bucket
            self._ahead.popleft()
            second = (run_ahead and self._depth > 1 and not self._ahead and self._may_run_ahead(seqs, bucket, mode)
                      and self._open_next_pages(seqs, rows, further=1))
            with self._guard():
                if second:
                    self.step.launch(bucket, mode, eager=False)
                out = self.step.collect(bucket)
            self.info["ahead_steps"] = self.info.get("ahead_steps", 0) + 1
            return self._finish(seqs, samplers, rows, bucket, mode, out, run_ahead, launched=second)
        if self._ahead:  # they ran for nothing: the device's ctrl is steps past the host's copy
            self._settle_ahead()
        self._grow_all(seqs)
        rows, bucket, moved = self.rows.assign([s.seq_id for s in seqs])
        fresh = set(moved)
        with self._guard(), self.dev.use():
            fed_changed = self.step.write_rows(rows, toks_in, [s.length for s in seqs],
                                               [s.page_table for s in seqs], bucket, fresh=fresh)
            for r, t, s, samp in zip(rows, toks_in, seqs, samplers, strict=True):
                if r in fresh:  # a sequence new to this row: its whole sampler state
                    samp.observe([t])
                    self.sampler_dev.load(r, samp, step=s.length + 1)
                elif r in fed_changed:  # a token the device did not draw
                    samp.observe([t])
                    if samp.params.repetition_penalty != 1.0:
                        self.sampler_dev.mark(r, t)
            out = self.step.run(bucket, mode, eager=self.decode_mode == "eager")
        self._count_launches()
        return self._finish(seqs, samplers, rows, bucket, mode, out, run_ahead)

    def _finish(self, seqs, samplers, rows, bucket, mode, out, run_ahead, launched: bool = False) -> list[int]:
        """The step's ids back to the caller's order; lengths and seen-sets advanced; the step after it
        recorded as ahead when `launched` (decode queued it before collecting this one), else maybe
        launched now."""
        toks = out[rows].tolist()
        for s, samp, t in zip(seqs, samplers, toks, strict=True):
            s.length += 1
            samp.seen[t] = True  # what observe([t]) does, for an id the device drew (in range by construction)
        self._last = ("decode", bucket, rows)
        if not launched and run_ahead and self._may_run_ahead(seqs, bucket, mode) and self._open_next_pages(seqs, rows):
            with self._guard():
                self.step.launch(bucket, mode, eager=False)
            launched = True
        if launched:
            self._ahead.append(_Ahead(bucket, rows, {s.seq_id: (r, s.length, t) for s, r, t in
                                                     zip(seqs, rows, toks, strict=True)}, mode))
        return toks

    def _may_run_ahead(self, seqs, bucket: int, mode: str) -> bool:
        """The next step may be launched before the caller asks for it when it needs nothing from the
        host: a captured greedy graph (a sampled row would spend a random draw and mark its seen-ids set
        on a step that may be discarded)."""
        return self.decode_mode == "graph" and mode == GREEDY and self.step.captured(bucket, mode)

    def _open_next_pages(self, seqs, rows, further: int = 0) -> bool:
        """Give each sequence whose next position (`further` positions past it: the step after a step
        still in flight) opens a page that page now, and tell the device, so the step run ahead has
        somewhere to write its K/V; False (do not run ahead) when the pool or a page table has no room for
        all of them, nothing changed then.

        Why: in a batch whose prompts were admitted in different steps the rows cross page boundaries
        at different steps, so at B = 32 or 64 some row opens a page on almost every step. Refusing to
        run ahead then (as the backend once did) left the host's per-step work exposed on nearly every
        step of a large batch. The page is the one the scheduler would reserve before the next step
        anyway (its _pages_to_grow is then 0); if the step ahead is discarded the sequence just holds
        it early, and it goes back with the others when the sequence is freed."""
        opening = [(s, r) for s, r in zip(seqs, rows, strict=True) if s.length + further >= s.capacity]
        if not opening:
            return True
        if len(opening) > self.pool.n_free or any(s.n_pages >= self.pool.max_pages_per_seq for s, _ in opening):
            return False
        cells = []
        for s, r in opening:
            self.pool.grow(s, s.length + further + 1)
            page = (s.length + further) // PAGE_TOKENS
            cells.append((r, page, int(s.page_table[page])))
        with self._guard(), self.dev.use():
            self.step.write_pages(cells)
        return True

    def _settle_ahead(self) -> None:
        """Discard the steps that ran ahead (their ids are never read; ctrl is rewritten at the next step)."""
        if self._ahead:
            self.info["ahead_discarded"] = self.info.get("ahead_discarded", 0) + len(self._ahead)
            self._ahead.clear()
            self.step.invalidate()

    def score(self, token_ids: np.ndarray) -> np.ndarray:
        """float32 [T, V]: the logits after each prefix, teacher-forced, in a temporary sequence freed
        afterwards. The layers are prefill's; the final norm and lm_head of every row run as fp32
        matmuls on the fp16 lm_head matrix (the int8 head's values rounded to fp16 unless lm_head_dtype is
        "fp16"; prefill's last row goes through the decode path's launch_head: at one row the int8 GEMV)."""
        ids = self._check_ids(token_ids)
        seq = self.pool.new_sequence()
        try:
            self.pool.grow(seq, int(ids.shape[0]))
            with self._guard(), self.dev.use():
                self.dev.h2d(self.pf_table, seq.page_table)
                x = self.prefill_pass.hidden(ids, 0, self.pf_table)
                return self.prefill_pass.all_logits(x)
        finally:
            self.pool.free(seq)

    def last_logits(self) -> np.ndarray:
        """float32 [B, V] of the last decode step (rows in the order its sequences were given), [1, V]
        after a prefill that sampled; a D2H copy, for debugging and the ladder."""
        if self._ahead:
            raise InvalidRequestError(
                "last_logits: the next decode step already ran ahead (decode(..., run_ahead=True)) and "
                "overwrote the logits; call decode without run_ahead to read them")
        with self.dev.use():
            if not self._last:
                return np.zeros((0, self.config.vocab), dtype=np.float32)
            if self._last[0] == "prefill":
                return self.dev.d2h(self.pf_logits[:self._last[1]])
            _, bucket, rows = self._last
            return self.dev.d2h(self.step.logits[:bucket])[rows]

    # ------------------------------------------------------------------ helpers
    def _check_ids(self, token_ids) -> np.ndarray:
        ids = np.asarray(token_ids).reshape(-1)
        if ids.shape[0] == 0:
            raise InvalidRequestError("at least one token id is needed")
        if not np.issubdtype(ids.dtype, np.integer):
            raise InvalidRequestError(f"token ids must be integers, got {ids.dtype}")
        if ids.min() < 0 or ids.max() >= self.config.vocab:
            raise InvalidRequestError(f"token id out of range 0..{self.config.vocab - 1}")
        return ids.astype(np.int32)

    def _check_batch(self, seqs, token_ids, samplers) -> list[int]:
        B = len(seqs)
        if len(token_ids) != B or len(samplers) != B:
            raise InvalidRequestError(
                f"decode needs one token id and one sampler per sequence: {B} sequences, "
                f"{len(token_ids)} ids, {len(samplers)} samplers")
        if B > self.max_batch:
            raise InvalidRequestError(f"a batch of {B} sequences exceeds max_batch {self.max_batch}")
        if len({s.seq_id for s in seqs}) != B:
            raise InvalidRequestError("a sequence appears twice in one decode batch")
        live = {s.seq_id for s in self.pool.sequences}
        out = []
        for s, t in zip(seqs, token_ids, strict=True):
            if s.seq_id not in live:
                raise InvalidRequestError(f"sequence {s.seq_id} is not live in this backend's pool")
            if isinstance(t, bool) or not isinstance(t, int | np.integer) or not 0 <= int(t) < self.config.vocab:
                raise InvalidRequestError(f"token id {t!r} outside the vocabulary 0..{self.config.vocab - 1}")
            if s.length < 1:
                raise InvalidRequestError(f"sequence {s.seq_id} has no prefilled tokens to decode after")
            out.append(int(t))
        return out

    def _grow_all(self, seqs: Sequence[SequenceState]) -> None:
        """One more token for every sequence, or (PromptTooLongError / KVPagesExhaustedError) for none.
        Only a sequence whose pages are full needs one (one in 16 steps)."""
        full = [s for s in seqs if s.length >= s.capacity]
        for s in full:
            if s.n_pages + 1 > self.pool.max_pages_per_seq:
                raise PromptTooLongError(
                    f"sequence {s.seq_id} is full: {s.length} tokens, the limit is {self.pool.max_tokens_per_seq}")
        if len(full) > self.pool.n_free:
            raise KVPagesExhaustedError(
                f"KV cache full: this decode step needs {len(full)} more pages of {PAGE_TOKENS} tokens, "
                f"{self.pool.n_free} of {self.pool.n_pages} free")
        for s in full:
            self.pool.grow(s, s.length + 1)

    def _count_launches(self) -> None:
        if self.step.launcher_calls is not None:
            self.info["launcher_calls_per_token"] = self.step.launcher_calls
        for (bucket, mode), n in self.step.graph_nodes.items():
            self.info[f"graph_kernel_nodes_{mode}" + ("" if bucket == 1 else f"_b{bucket}")] = n

    def _guard(self):
        return _RequestGuard(self)

    def close(self) -> None:
        """Drop every device buffer (the pool of cupy frees them) so another model can load."""
        self._ahead.clear()
        for name in ("w", "k_cache", "v_cache", "step", "prefill_pass", "sampler_dev", "ks"):
            setattr(self, name, None)
        self.dev.release_cached()


class _RequestGuard:
    """Marks cached device state stale on any failure; turns out-of-memory into GPUOutOfMemoryError."""

    def __init__(self, be: CudaBackend):
        self.be = be

    def __enter__(self):
        return self

    def __exit__(self, et, e, tb):
        if e is None:
            return False
        be = self.be
        be._ahead.clear()
        be.step.invalidate()
        be.rows.clear()  # every row's sampler state is uploaded again when next used
        be._last = ()
        if be.dev.is_oom(e):
            be.dev.release_cached()
            raise GPUOutOfMemoryError(f"out of GPU memory during the request: {e}") from None
        return False


class _Ahead:
    """A decode step launched before its call: which rows it ran and, per sequence, (row, the length the
    step started from, the id it was fed)."""

    def __init__(self, bucket: int, rows: list[int], by_seq: dict[int, tuple[int, int, int]], mode: str):
        self.bucket, self.rows, self.by_seq, self.mode = bucket, rows, by_seq, mode

    def serves(self, seqs, toks_in: list[int], mode: str, assignment: RowAssignment) -> bool:
        """Whether the call (seqs, toks_in) is the one this step computed: the same sequences, each still
        in its row, at the length and fed the id the step assumed, in the same mode."""
        if mode != self.mode or len(seqs) != len(self.by_seq):
            return False
        for s, t in zip(seqs, toks_in, strict=True):
            want = self.by_seq.get(s.seq_id)
            if want is None or (want[1], want[2]) != (s.length, t) or assignment.owner[want[0]] != s.seq_id:
                return False
        # the rows in the caller's order (the step's own order may differ: same rows, another listing)
        self.rows = [self.by_seq[s.seq_id][0] for s in seqs]
        return True
