"""One batched decode step on the GPU: its device buffers, its launch sequence, and the CUDA graphs that
replay it (one per batch bucket, sampling mode and context range, captured on first use).

A step turns the token in row b of `ctrl` at row b's position into row b's next token, for rows
[0, bucket): the sampler writes the new ids back into ctrl's token rows inside the same graph, and
`advance` moves every active row's position and length on the device. The host reads back only the
bucket's token ids (4 bytes a row) to stream them.

    ctrl: int32, one buffer so that whatever changed between two steps is one H2D copy
      [0, R)                  TOKEN    row b's token fed into the step (the sampler overwrites it)
      [Rp, Rp + R)            POS      its position: its K/V go to page table[POS // 16], slot POS % 16
      [2 Rp, 2 Rp + R)        SEQ_LEN  POS + 1: attention reads positions [0, SEQ_LEN); 0 = idle row
      [3 Rp, 3 Rp + R * P)    TABLE    [R, P] page table of row b's sequence (-1 past its pages)
    R = max_batch rows, Rp = R rounded up to 4 (each section 16-byte aligned), P = max pages per sequence.
    The kernels of bucket B get the first B entries of each section: contiguous views.

Why one graph per bucket serves every step: no kernel argument depends on the step. Every kernel reads
positions, lengths and page tables from `ctrl` at run time, so a page boundary is just another value of
POS, and a row changing hands is a different page table in ctrl; the graph's pointers (weights, cache,
buffers) never change after load. The host keeps a shadow of ctrl as it stands on the device (advanced
the way `advance` advances it) and copies only the span of entries that differ (write_rows): for a steady
batch that is nothing, or the new page ids of the rows that crossed into a page.

Each context range gets its own graphs, chosen by the bucket's longest sequence (the host knows it before it
launches a step), because decode attention's best grid depends on it (nanoqwen_kernels.attention):
- up to SHORT_CONTEXT_TOKENS (1,024): the short-context launch, one cluster of 8 blocks per sequence and KV
  head. The default grid (7B at batch 1: 5 clusters, 160 blocks) reads such a sequence with its first cluster
  alone, the other 128 blocks only start, wait for q/k/v and leave. Its build's consumers take their pages
  two at a time (attention SHORT_PAIR), so its outputs are the default grid's to fp16 rounding, not bit for bit.
  Its graph key's mode is the plain mode ("greedy").
- from LONG_CONTEXT_TOKENS (8,192): the long-context build (clusters of up to 16 blocks: attention
  LONG_CLUSTER_MAX), which streams a long context faster but starts later behind the previous kernel than the
  default build's clusters of 8. Mode + LONG_SUFFIX ("greedy@long"). Measured (H200, 7B, decode of 128 tokens
  after a prompt, ms/token, docs/PERF.md twenty-fifth lease): at 8,000 tokens 1.675 -> 1.668, at 32,000 2.048
  -> 2.017-2.021; at 640 the long build lost ~8 us a token (twenty-fourth lease), so the line sits between
  (below 8k the step was not measured).
- between: the default grid, mode + MID_SUFFIX ("greedy@mid").

Idle rows (inside the bucket, held by no sequence) run with POS 0, SEQ_LEN 0 and TABLE[b][0] = the
scratch page, a page of the cache outside the pool that no sequence owns: their K/V write lands there,
their attention reads nothing, and their sampled ids are dropped. `advance` leaves them idle.

Buffers (per backend, [R, ...] allocated once at load; H hidden, I intermediate, Q = n_heads*128, V vocab):
    x, y    f16 [R, H]  residual stream, ping-pong (o_proj: x -> y, down_proj: y -> x; no in-place aliasing)
    q, attn f16 [R, Q]  roped queries / attention outputs
    act     f16 [R, I]  silu(gate) * up
    xn      f16 [R, H]  final-normed hidden states
    logits  f32 [R, V]  lm_head outputs (fp32 so the sampler and the ladder see unrounded logits; at B = 1
                        from the int8 head when there is one: launch_head)
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from nanoqwen_kernels.attention import SHORT_CONTEXT_TOKENS

from .sampling import DeviceSampler
from .weights import GpuWeights

SPAN_GAP = 16384  # entries (64 KiB): changed entries closer than this go to the device in one copy
ID_SLOTS = 3  # pinned slots for launched steps' ids: at most 2 steps are in flight (backend.decode)
LONG_SUFFIX = "@long"  # a graph key's mode for the long-context step
MID_SUFFIX = "@mid"  # ... for a step whose longest sequence is neither short nor long
DEFAULT_LONG_CONTEXT_TOKENS = 8192
DEFAULT_SHORT_CONTEXT_TOKENS = SHORT_CONTEXT_TOKENS  # where the default grid's first cluster reads everything


def _tokens_from_env(name: str, default: int) -> int:
    """A number of tokens from $name (0 = never; unset or empty: default); anything else is one clear error."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name}={raw!r}: a number of tokens (0 = never)")
    return value


def long_context_tokens() -> int:
    """$NANOQWEN_DECODE_LONG_CONTEXT: the longest sequence's length (tokens, the step's own included) from
    which a step launches the long-context attention build; 0 = never. Default DEFAULT_LONG_CONTEXT_TOKENS."""
    return _tokens_from_env("NANOQWEN_DECODE_LONG_CONTEXT", DEFAULT_LONG_CONTEXT_TOKENS)


def short_context_tokens() -> int:
    """$NANOQWEN_DECODE_SHORT_CONTEXT: the longest sequence's length (tokens, the step's own included) up to
    which a step launches decode attention's short-context grid; 0 = never. Default
    DEFAULT_SHORT_CONTEXT_TOKENS (past it the short grid is still right, and slower)."""
    return _tokens_from_env("NANOQWEN_DECODE_SHORT_CONTEXT", DEFAULT_SHORT_CONTEXT_TOKENS)


def _spans(cells: np.ndarray) -> list[tuple[int, int]]:
    """[lo, hi) spans covering the changed entries `cells`; two are merged when less than SPAN_GAP apart."""
    if cells.size == 0:
        return []
    cells = np.unique(cells)
    cuts = np.flatnonzero(np.diff(cells) > SPAN_GAP)
    starts = np.concatenate([[0], cuts + 1])
    ends = np.concatenate([cuts, [cells.size - 1]])
    return [(int(cells[a]), int(cells[b]) + 1) for a, b in zip(starts, ends, strict=True)]


class CountingKernels:
    """Proxy counting launcher calls (a launcher may issue more than one kernel; the graph count says).
    dry=True counts without launching (the load-time figure in engine.info)."""

    def __init__(self, ks, dry: bool = False):
        self._ks = ks
        self._dry = dry
        self.calls = 0

    def __getattr__(self, name):
        fn = getattr(self._ks, name)
        if not callable(fn):
            return fn

        def counted(*a, **k):
            self.calls += 1
            return None if self._dry else fn(*a, **k)

        return counted


@dataclass(frozen=True)
class CtrlLayout:
    rows: int  # R
    max_pages: int  # P

    @property
    def stride(self) -> int:  # Rp
        return -(-self.rows // 4) * 4

    @property
    def pos(self) -> int:
        return self.stride

    @property
    def seq_len(self) -> int:
        return 2 * self.stride

    @property
    def table(self) -> int:
        return 3 * self.stride

    @property
    def size(self) -> int:
        return self.table + self.rows * self.max_pages


@dataclass(frozen=True)
class BucketViews:
    """The first B rows of every buffer: what the kernels of bucket B read and write."""

    tokens: Any
    pos: Any
    seq_len: Any
    table: Any
    x: Any
    y: Any
    q: Any
    attn: Any
    act: Any
    xn: Any
    logits: Any


class DecodeStep:
    def __init__(self, dev, ks, weights: GpuWeights, cfg, k_cache, v_cache, max_pages: int, max_batch: int,
                 sampler: DeviceSampler, scratch_page: int):
        xp = dev.xp
        self.dev, self.ks, self.w, self.cfg = dev, ks, weights, cfg
        self.k_cache, self.v_cache = k_cache, v_cache
        self.max_batch, self.scratch_page = max_batch, scratch_page
        R = max_batch
        self.layout = lay = CtrlLayout(R, max_pages)
        self.ctrl = xp.zeros(lay.size, dtype=np.int32)
        H, Q, Im, V = cfg.hidden, cfg.q_dim, cfg.intermediate, cfg.vocab
        self.x = xp.zeros((R, H), dtype=np.float16)
        self.y = xp.zeros((R, H), dtype=np.float16)
        self.q = xp.zeros((R, Q), dtype=np.float16)
        self.attn = xp.zeros((R, Q), dtype=np.float16)
        self.act = xp.zeros((R, Im), dtype=np.float16)
        self.xn = xp.zeros((R, H), dtype=np.float16)
        self.logits = xp.zeros((R, V), dtype=np.float32)
        self.attn_ws = ks.attention_workspace(R)
        self.sampler = sampler
        self.long_from = long_context_tokens()  # 0: no step on the long-context build
        self.short_until = short_context_tokens()  # 0: no step on the short-context grid
        self.graphs: dict[tuple[int, str], Any] = {}  # (bucket, mode[@mid|@long]) -> graph, or "pending"
        self.graph_nodes: dict[tuple[int, str], int | None] = {}
        self.launcher_calls: int | None = None  # per step, counted on the first eager step
        self.shadow: np.ndarray | None = None  # host copy of ctrl as it stands on the device
        # Each launched step's sampled ids are copied out right behind it on the stream, into a pinned slot
        # of its own, so a second step may be queued before the host reads the first one's ids (the next
        # step overwrites ctrl's tokens): launch() appends (slot, bucket), collect() takes the oldest.
        self._id_slots = dev.pinned((ID_SLOTS, R), np.int32)
        self._id_events = [dev.event() for _ in range(ID_SLOTS)]
        self._next_slot = 0
        self._pending: deque[tuple[int, int]] = deque()

    @property
    def workspace_bytes(self) -> int:
        arrs = [self.ctrl, self.x, self.y, self.q, self.attn, self.act, self.xn, self.logits, self.attn_ws]
        return sum(int(a.nbytes) for a in arrs) + self.sampler.nbytes

    def views(self, B: int) -> BucketViews:
        lay, c = self.layout, self.ctrl
        return BucketViews(
            tokens=c[0:B], pos=c[lay.pos:lay.pos + B], seq_len=c[lay.seq_len:lay.seq_len + B],
            table=c[lay.table:lay.table + B * lay.max_pages].reshape(B, lay.max_pages),
            x=self.x[:B], y=self.y[:B], q=self.q[:B], attn=self.attn[:B], act=self.act[:B], xn=self.xn[:B],
            logits=self.logits[:B])

    # ------------------------------------------------------------------ launches
    def launch_body(self, ks, B: int, mode: str, span: str = MID_SUFFIX) -> None:
        """Every launch of one step of rows [0, B) from embedding to sampled ids (captured as one graph);
        span: the context range's suffix (context_span), which picks decode attention's launch."""
        v = self.views(B)
        ks.embed(self.w.embed, v.tokens, v.x)
        for i in range(self.cfg.n_layers):
            self.launch_layer(ks, i, v, span)
        self.launch_head(ks, v.x, v.xn, v.logits)
        self.sampler.launch(ks, mode, v.logits, v.tokens, 0, B)
        ks.advance(v.pos, v.seq_len)

    @staticmethod
    def attention_launcher(ks, span: str = MID_SUFFIX):
        """Decode attention's launcher for a context range (context_span's suffix): the short-context grid,
        the default one (MID_SUFFIX) or the long-context build."""
        return {"": ks.attention_decode_short, MID_SUFFIX: ks.attention_decode,
                LONG_SUFFIX: ks.attention_decode_long}[span]

    @staticmethod
    def gemv_launchers(ks, span: str, rows: int):
        """(qkv_rope_kv, gate_up_silu) for a context range and a step of `rows` rows: the short-context GEMV
        build at batch 1 in the short range (it differs from the default build only in its B = 1 loop), else
        the default build."""
        if span == "" and rows == 1:
            return ks.qkv_rope_kv_short, ks.gate_up_silu_short
        return ks.qkv_rope_kv, ks.gate_up_silu

    def context_span(self, longest: int) -> str:
        """The context range of a step whose longest sequence holds `longest` tokens (its own included): ""
        (short: up to short_until), LONG_SUFFIX (from long_from), else MID_SUFFIX."""
        if self.long_from and longest >= self.long_from:
            return LONG_SUFFIX
        if self.short_until and longest <= self.short_until:
            return ""
        return MID_SUFFIX

    def launch_layer(self, ks, i: int, v: BucketViews, span: str = MID_SUFFIX) -> None:
        """Decoder layer i on v.x (in place, through v.y) for each row's token at its POS; span: the context
        range (context_span), which picks decode attention's launch and, for short contexts at batch 1, the
        GEMV build of q/k/v and gate/up (nanoqwen_kernels.gemv_b1 b1_short_defines: the 7B's prologues shared by
        clusters; it changes only the batch-1 loop, so a batch runs the default build)."""
        lw, eps = self.w.layers[i], self.cfg.rms_eps
        qkv_rope_kv, gate_up_silu = self.gemv_launchers(ks, span, v.x.shape[0])
        # settled: POS and the page tables were written before the step's first kernel (write_rows' copy, the
        # previous step's advance), so q/k/v's B = 1 loop may read them before its launch-overlap wait
        qkv_rope_kv(lw.qkv.qweight, lw.qkv.scales, lw.qkv_bias, v.x, lw.in_norm, eps, v.pos, v.table,
                       self.k_cache, self.v_cache, i, v.q, settled=True)
        attend = self.attention_launcher(ks, span)
        attend(v.q, self.k_cache, self.v_cache, v.table, v.seq_len, i, v.attn, self.attn_ws)
        ks.gemv_int4(lw.o.qweight, lw.o.scales, v.attn, v.y, residual=v.x)
        if v.act.shape[0] == 1 and getattr(ks, "gemv_variant", None) == "a8" and getattr(ks, "a8_image_pair", True):
            # int8 decode activations where the kernels choose the image pair (nanoqwen_kernels.gemv
            # b1_a8_image_pair: the 1.5B, not the 7B): gate/up hands down_proj its input already rounded (the
            # a8 image in v.act's storage), so down_proj's blocks do not each round the whole intermediate
            # (docs/KERNELS.md)
            gate_up_silu(lw.gate_up.qweight, lw.gate_up.scales, v.y, lw.post_norm, eps, v.act, a8_image=True)
            ks.gemv_int4(lw.down.qweight, lw.down.scales, v.act, v.x, residual=v.y, x_a8_image=True)
            return
        gate_up_silu(lw.gate_up.qweight, lw.gate_up.scales, v.y, lw.post_norm, eps, v.act)
        ks.gemv_int4(lw.down.qweight, lw.down.scales, v.act, v.x, residual=v.y)

    def launch_head(self, ks, x_rows, xn_rows, logits_rows) -> None:
        """Final RMSNorm + lm_head of hidden rows [B, H] into logits [B, V] (decode, and prefill's last row).

        With the int8 head (weights.with_int8_head) a single row goes through its GEMV, which reads half the
        bytes of the fp16 matrix; B >= 2 rows multiply the fp16 copy of the same values through gemv_fp16
        (the int8 GEMV takes one row; a batch shares each weight read among its rows anyway). The choice is
        per launch: a captured graph's batch is fixed, so it replays the launch it captured."""
        ks.rmsnorm(x_rows, self.w.final_norm, xn_rows, self.cfg.rms_eps)
        head = self.w.lm_head_i8
        if head is not None and xn_rows.shape[0] == 1:
            ks.gemv_head_i8(head.q, head.s, xn_rows, logits_rows)
        else:
            ks.gemv_fp16(self.w.lm_head, xn_rows, logits_rows)

    def count_launcher_calls(self) -> int:
        """Launcher calls of one greedy step, counted without launching anything (the same for every B)."""
        counting = CountingKernels(self.ks, dry=True)
        self.launch_body(counting, 1, "greedy")
        return counting.calls

    # ------------------------------------------------------------------ host side
    def write_rows(self, rows: Sequence[int], tokens: Sequence[int], positions: Sequence[int],
                   tables: Sequence[np.ndarray], bucket: int, fresh: set[int] | None = None) -> set[int]:
        """Make ctrl describe this step: row rows[i] feeds tokens[i] at positions[i] of the sequence whose
        page table is tables[i]; every other row below `bucket` is idle. `fresh` are the rows that hold a
        different sequence than in the previous step (their whole page table is written; None: every
        row). Copies to the device only the entries that differ from what it holds: one H2D copy of
        that span (several when the changed entries lie far apart in a large table; none when nothing
        changed).

        A row's page-table entries past the page of its position are never read (attention reads pages
        < ceil(SEQ_LEN / 16), the K/V write goes to page POS // 16), so a continuing row can only change
        in its last entry: the host compares one entry per row per step, not whole tables.

        Returns the rows whose fed token differs from the one the device holds there (the device did not
        draw it: its seen-ids mask needs it)."""
        lay, P = self.layout, self.layout.max_pages
        full = self.shadow is None
        if full:
            self.shadow = np.zeros(lay.size, dtype=np.int32)
        sh = self.shadow
        idx = np.asarray(rows, dtype=np.int64)
        tok = np.asarray(tokens, dtype=np.int32)
        pos = np.asarray(positions, dtype=np.int32)
        fed_changed = set(idx[sh[idx] != tok].tolist())
        idle = np.ones(bucket, dtype=bool)
        idle[idx] = False
        idle = np.flatnonzero(idle)
        # the header of rows [0, bucket): tokens, positions, lengths (idle rows: 0, 0)
        want = np.empty((3, bucket), dtype=np.int32)
        want[0] = sh[0:bucket]
        want[1:, idle] = 0
        want[0, idx], want[1, idx], want[2, idx] = tok, pos, pos + 1
        changed = []
        for k, base in enumerate((0, lay.pos, lay.seq_len)):
            ne = np.flatnonzero(sh[base:base + bucket] != want[k])
            sh[base + ne] = want[k, ne]
            changed.append(base + ne)
        # page tables: an idle row's first entry is the scratch page; a continuing row's last entry (the
        # page of its position); a fresh row's entries up to that page
        last = pos // 16
        cells = [lay.table + idle * P, lay.table + idx * P + last]
        vals = [np.full(idle.size, self.scratch_page, dtype=np.int32),
                np.fromiter((t[n] for t, n in zip(tables, last.tolist(), strict=True)), np.int32, idx.size)]
        for i, r in enumerate(idx.tolist()):
            if full or fresh is None or r in fresh:
                cells.append(np.arange(lay.table + r * P, lay.table + r * P + last[i]))
                vals.append(tables[i][: last[i]])
        c, v = np.concatenate(cells), np.concatenate(vals).astype(np.int32, copy=False)
        ne = sh[c] != v
        sh[c[ne]] = v[ne]
        changed.append(c[ne])
        if full:
            self.dev.h2d(self.ctrl, sh)
        else:
            for lo, hi in _spans(np.concatenate(changed)):
                self.dev.h2d(self.ctrl[lo:hi], sh[lo:hi])
        return fed_changed

    def write_pages(self, cells: Sequence[tuple[int, int, int]]) -> None:
        """Set page-table entries (row, index, page id) in ctrl, on the device and in the host's shadow:
        the pages a step run ahead opens (backend._open_next_pages). Ordered on the stream before the
        next launch; the step that just finished never read these entries (past its positions)."""
        assert self.shadow is not None, "write_pages follows a step (ctrl's shadow exists)"
        lay, sh = self.layout, self.shadow
        idx = np.array([lay.table + r * lay.max_pages + n for r, n, _ in cells], dtype=np.int64)
        sh[idx] = np.array([p for _, _, p in cells], dtype=np.int32)
        for lo, hi in _spans(idx):
            self.dev.h2d(self.ctrl[lo:hi], sh[lo:hi])

    def invalidate(self) -> None:
        """Forget what ctrl holds (after an error, or steps launched ahead for nothing): the next step
        copies all of it, and the ids of steps launched but not collected are never read."""
        self.shadow = None
        self._pending.clear()

    @property
    def in_flight(self) -> int:
        """Steps launched whose ids are not collected yet."""
        return len(self._pending)

    def graph_key(self, bucket: int, mode: str) -> tuple[int, str]:
        """The graph the next step of rows [0, bucket) launches: (bucket, mode + context_span(longest)) for the
        longest of those rows. The host's shadow holds each row's length as of the last step collected or
        written; every step launched and not collected adds one. Without a shadow (nothing written yet, or
        after a reset) the default grid's graph (MID_SUFFIX): right at any length."""
        if self.shadow is None:
            return bucket, mode + MID_SUFFIX
        lay = self.layout
        longest = int(self.shadow[lay.seq_len:lay.seq_len + bucket].max(initial=0)) + len(self._pending)
        return bucket, mode + self.context_span(longest)

    def captured(self, bucket: int, mode: str) -> bool:
        """Whether the next step of (bucket, mode) has its graph (graph_key): it is a plain replay."""
        g = self.graphs.get(self.graph_key(bucket, mode))
        return g is not None and not isinstance(g, str)

    def run(self, bucket: int, mode: str, eager: bool) -> np.ndarray:
        """Run one step of rows [0, bucket) (ctrl already written); returns their sampled ids, int32 [bucket]."""
        self.launch(bucket, mode, eager)
        return self.collect(bucket)

    def launch(self, bucket: int, mode: str, eager: bool) -> None:
        """Enqueue one step of rows [0, bucket) on the device's stream; nothing waits for it."""
        dev, key = self.dev, self.graph_key(bucket, mode)
        span = key[1][len(mode):]
        with dev.use():
            if eager or key not in self.graphs:
                # The first step of each (bucket, mode) runs eagerly: it loads every kernel it needs and
                # counts the launches; capturing happens on the next step (nothing executes while a
                # stream is capturing, so the capture must not be the first use of a kernel).
                counting = CountingKernels(self.ks)
                self.launch_body(counting, bucket, mode, span)
                self.launcher_calls = counting.calls
                if not eager:
                    self.graphs[key] = "pending"
            elif self.graphs[key] == "pending":
                graph = dev.capture(lambda: self.launch_body(self.ks, bucket, mode, span))
                self.graphs[key] = graph
                self.graph_nodes[key] = dev.graph_kernel_nodes(graph)
                dev.replay(graph)
            else:
                dev.replay(self.graphs[key])
            slot = self._next_slot
            self._next_slot = (slot + 1) % ID_SLOTS
            dev.d2h_async(self.ctrl[0:bucket], self._id_slots[slot], self._id_events[slot])
            self._pending.append((slot, bucket))

    def collect(self, bucket: int) -> np.ndarray:
        """Wait for the oldest step launched and not yet collected and read its sampled ids, int32
        [bucket]; the host's copy of ctrl then mirrors what the step did on the device (each active row
        fed the id it drew, one position on)."""
        slot, launched = self._pending.popleft()
        assert launched == bucket, f"collect({bucket}) of a step launched for bucket {launched}"
        self.dev.wait(self._id_events[slot])
        toks = self._id_slots[slot, :bucket].copy()
        s = self.shadow
        if s is not None:  # mirror what the step did on the device
            lay = self.layout
            s[0:bucket] = toks
            act = s[lay.seq_len:lay.seq_len + bucket] > 0
            s[lay.pos:lay.pos + bucket][act] += 1
            s[lay.seq_len:lay.seq_len + bucket][act] += 1
        return toks
