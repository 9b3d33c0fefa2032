"""One decode step on the GPU: its device buffers, its launch sequence, and the CUDA graph that replays it.

A step turns the token in `ctrl[TOKEN]` at position `ctrl[POS]` into the next token id, written back
into `ctrl[TOKEN]` by the sampler inside the same graph; `advance` then moves POS and SEQ_LEN on the
device. The host only reads the sampled id (4 bytes) to stream it.

    ctrl: int32 [4 + max_pages_per_seq]       (one buffer so a sequence switch is one H2D copy)
      [0] TOKEN     the token fed into the step; the sampler overwrites it with the next one
      [1] POS       its position; the K/V of this token go to page_table[POS // 16], slot POS % 16
      [2] SEQ_LEN   POS + 1: attention reads positions [0, SEQ_LEN)
      [3] (pad: keeps the page table 16-byte aligned)
      [4:] page table of the active sequence (logical block -> page id; -1 past its pages)

Why one graph serves every token (the seed captured two graphs, one for steps that cross into a new page
and one for the rest, and picked one with a modulo): there, the page and slot of the new K/V were
computed on the host and baked into the captured kernel arguments. Here no kernel argument depends on the
step: every kernel reads POS, SEQ_LEN and the page table from `ctrl` at run time, so a page boundary is
just another value of POS. The only host work at a boundary is writing the new page id into ctrl's page
table (an H2D copy before the replay, ordered on the same stream), and a sequence switch is a copy of
that sequence's whole table. The graph's pointers (weights, cache, buffers) never change after load.

Buffers (per backend, allocated once at load; H = hidden, I = intermediate, Q = n_heads*128, V = vocab):
    x, y    f16 [H]   residual stream, ping-pong (o_proj: x -> y, down_proj: y -> x; no in-place aliasing)
    q, attn f16 [Q]   roped query / attention output
    act     f16 [I]   silu(gate) * up
    xn      f16 [H]   final-normed hidden state
    logits  f32 [V]   lm_head output (fp32 so the sampler and the ladder see unrounded logits)
"""

from __future__ import annotations

import numpy as np

TOKEN, POS, SEQ_LEN = 0, 1, 2
CTRL_HEADER = 4


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


class DecodeStep:
    def __init__(self, dev, ks, weights: dict, cfg, k_cache, v_cache, max_pages: int, sampler_dev):
        xp = dev.xp
        self.dev, self.ks, self.w, self.cfg = dev, ks, weights, cfg
        self.k_cache, self.v_cache = k_cache, v_cache
        H, Q, Im, V = cfg.hidden, cfg.q_dim, cfg.intermediate, cfg.vocab
        self.ctrl = xp.zeros(CTRL_HEADER + max_pages, dtype=np.int32)  # int32 [4 + max_pages]
        self.token = self.ctrl[TOKEN:TOKEN + 1]  # int32 [1]
        self.pos = self.ctrl[POS:POS + 1]  # int32 [1]
        self.seq_len = self.ctrl[SEQ_LEN:SEQ_LEN + 1]  # int32 [1]
        self.page_table = self.ctrl[CTRL_HEADER:]  # int32 [max_pages]
        self.x = xp.zeros(H, dtype=np.float16)
        self.y = xp.zeros(H, dtype=np.float16)
        self.q = xp.zeros(Q, dtype=np.float16)
        self.attn = xp.zeros(Q, dtype=np.float16)
        self.act = xp.zeros(Im, dtype=np.float16)
        self.xn = xp.zeros(H, dtype=np.float16)
        self.logits = xp.zeros(V, dtype=np.float32)
        self.attn_ws = ks.attention_workspace() if hasattr(ks, "attention_workspace") else None
        self.sampler = sampler_dev
        self.graphs: dict[str, object] = {}
        self.launcher_calls: int | None = None  # per token, counted on the first eager step
        self.graph_nodes: dict[str, int | None] = {}
        self.ctrl_shadow: np.ndarray | None = None  # host copy of what ctrl holds on the device

    @property
    def workspace_bytes(self) -> int:
        arrs = [self.ctrl, self.x, self.y, self.q, self.attn, self.act, self.xn, self.logits]
        n = sum(int(a.nbytes) for a in arrs)
        if self.attn_ws is not None:
            n += int(getattr(self.attn_ws, "nbytes", 0))
        return n + self.sampler.nbytes

    # ------------------------------------------------------------------ launches
    def launch_body(self, ks, mode: str) -> None:
        """Every launch of one token from embedding to sampled id (captured as one graph)."""
        ks.embed(self.w["embed"], self.token, self.x)
        for i in range(self.cfg.n_layers):
            self.launch_layer(ks, i)
        self.launch_head(ks, self.x)
        self.sampler.launch(ks, mode, self.logits, self.token)
        ks.advance(self.pos, self.seq_len)

    def launch_layer(self, ks, i: int) -> None:
        """Decoder layer i on self.x (in place, through y) for the token at POS."""
        w, eps = self.w, self.cfg.rms_eps
        ks.qkv_rope_kv(w[f"{i}.qkv.w"], w[f"{i}.qkv.s"], w[f"{i}.qkv.b"], self.x, w[f"{i}.ln1"], eps,
                       self.pos, self.page_table, self.k_cache, self.v_cache, i, self.q)
        ks.attention_decode(self.q, self.k_cache, self.v_cache, self.page_table, self.seq_len, i,
                            self.attn, self.attn_ws)
        ks.gemv_int4(w[f"{i}.o.w"], w[f"{i}.o.s"], self.attn, self.y, residual=self.x)
        ks.gate_up_silu(w[f"{i}.gu.w"], w[f"{i}.gu.s"], self.y, w[f"{i}.ln2"], eps, self.act)
        ks.gemv_int4(w[f"{i}.down.w"], w[f"{i}.down.s"], self.act, self.x, residual=self.y)

    def launch_head(self, ks, x_row) -> None:
        """Final RMSNorm + lm_head of one hidden row into self.logits (decode and prefill's last row)."""
        ks.rmsnorm(x_row, self.w["norm"], self.xn, self.cfg.rms_eps)
        ks.gemv_fp16(self.w["lm_head"], self.xn, self.logits)

    def count_launcher_calls(self) -> int:
        """Launcher calls of one greedy token, counted without launching anything."""
        counting = CountingKernels(self.ks, dry=True)
        self.launch_body(counting, "greedy")
        return counting.calls

    # ------------------------------------------------------------------ host side
    def sync_ctrl(self, seq, token_id: int) -> bool:
        """Make ctrl describe (seq, token_id at position seq.length); copy only when it differs.

        Returns whether the header (token, position) changed, i.e. not only a new page id: another
        sequence, or a token the device did not sample itself."""
        want = np.empty(self.ctrl.shape[0], dtype=np.int32)
        want[TOKEN], want[POS], want[SEQ_LEN], want[3] = token_id, seq.length, seq.length + 1, 0
        want[CTRL_HEADER:] = seq.page_table[: want.shape[0] - CTRL_HEADER]
        old = self.ctrl_shadow
        if old is not None and np.array_equal(want, old):
            return False
        self.dev.h2d(self.ctrl, want)
        self.ctrl_shadow = want
        return old is None or not np.array_equal(want[:CTRL_HEADER], old[:CTRL_HEADER])

    def invalidate(self) -> None:
        """Forget what ctrl holds (after prefill/score wrote it, or after an error)."""
        self.ctrl_shadow = None

    def step(self, mode: str, eager: bool) -> int:
        """Run one token (ctrl already synced); returns the sampled id."""
        dev = self.dev
        with dev.use():
            if eager or mode not in self.graphs:
                # The first step of each sampling mode runs eagerly: it loads every kernel module and
                # counts the launches; capturing happens on the next step (nothing is executed while a
                # stream is capturing, so the capture itself must not be the first use of a kernel).
                counting = CountingKernels(self.ks)
                self.launch_body(counting, mode)
                self.launcher_calls = counting.calls
                if not eager:
                    self.graphs[mode] = "pending"
            elif self.graphs[mode] == "pending":
                graph = dev.capture(lambda: self.launch_body(self.ks, mode))
                self.graphs[mode] = graph
                self.graph_nodes[mode] = dev.graph_kernel_nodes(graph)
                dev.replay(graph)
            else:
                dev.replay(self.graphs[mode])
            tok = int(dev.d2h(self.token)[0])
        shadow = self.ctrl_shadow
        if shadow is not None:
            shadow[TOKEN] = tok
            shadow[POS] += 1
            shadow[SEQ_LEN] += 1
        return tok
