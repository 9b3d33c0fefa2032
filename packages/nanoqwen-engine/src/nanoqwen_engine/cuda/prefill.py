"""Prefill on the GPU: the whole prompt through the GEMM path, filling the sequence's KV pages.

Per layer, for T prompt rows at positions start .. start+T-1 (H hidden, R = (n_heads + 2 n_kv) * 128,
Q = n_heads * 128, I intermediate; every activation f16, row-major):

    x [T,H] --rmsnorm_rows--> h [T,H] --gemm_int4 qkv--> qkv [T,R]
        --rope_kv_prefill (+ bias, in fp32)--> q [T,Q] (+ K/V of the T rows written into their pages)
        --attention_prefill (causal over [0, start+T))--> a [T,Q] --gemm_int4 o, accumulate--> x += o
    x --rmsnorm_rows--> h --gemm_int4 gate|up--> gu [T,2I] --silu(gate)*up--> act [T,I]
        --gemm_int4 down, accumulate--> x += d
    (on the INT4 weights as stored, gate|up and silu are one kernel: gemm_int4_wg_silu -> act [T,I])

(The residual adds are the GEMMs' beta = 1: cuBLAS adds x while it writes, in fp32, no extra kernel.)
The MLP activation is one kernel (silu_mul, fp32 inside). A pass whose pieces, each padded to a bucket
of rows (GRAPH_BUCKETS), fit GRAPH_MAX_ROWS replays a CUDA graph captured for that shape (the launches
above, with the token ids and each piece's start position and real row count read from device memory),
because a short pass is host-bound; longer passes run eagerly (GPU-bound by then).
Each GEMM reads the layer's resident f16 copy of its matrix when the backend keeps one (gemm_f16, cuBLAS;
plan.choose_prefill_weights), else the INT4 matrix as stored (gemm_int4_wg: dequantized in registers into
the tensor cores' operands, no fp16 copy anywhere): the same f16 weight values either way, fp32 sums.
Opt-in ("fp8"): each GEMM's X is first rounded to e4m3 with a scale per token (quantize_e4m3 into xq / sx),
then multiplied on the FP8 tensor cores with the layer's resident e4m3 copy of the weights (gemm_fp8;
gate|up + SiLU as gemm_fp8_silu): the same weights, the activations rounded (kernels' prefill_fp8.py).

Several sequences' prompts (or chunks) can go through together (hidden_many): their rows are stacked and
share the GEMMs, while RoPE + K/V write and attention run per sequence. Passes hold PREFILL_CHUNK rows
at most: a longer prompt goes in pieces, each a prefill at a later start position whose attention also
reads the pages the earlier pieces wrote, so the temporaries stay bounded (7B, 8192 rows: gu is
8192 x 37888 x 2 B = 621 MB) whatever the prompt length.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
from nanoqwen_kernels.prefill_gemm import WORKSPACE_CAP

from .weights import DenseLayer, Fp8Layer, GpuWeights

# Rows per pass at most. H200, 7B, 32,768 prompt tokens in passes of 4,096 / 8,192 / 16,384 / 32,768 rows:
# 1,245 / 1,222 / 1,226 / 1,238 ms (scripts/prefill_breakdown.py, docs/PERF.md "twelfth lease")
PREFILL_CHUNK = 8192
# A pass of pieces of at most GRAPH_BUCKETS[-1] tokens each, GRAPH_MAX_ROWS rows in all once each piece is
# padded to its bucket, replays a CUDA graph captured for that shape (a piece's padding rows: token 0, no
# K/V written, attention neither reads nor writes them). Below ~512 rows a pass is host-bound: ~250 launcher
# calls of Python (~220 us per layer) against a few ms of GPU work. Every graph works in one set of buffers
# of GRAPH_MAX_ROWS rows (passes run one after another on one stream); the GRAPH_CACHE most recently used
# shapes keep their graphs.
GRAPH_BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512)
GRAPH_MAX_ROWS = 512
# A call of at most this many rows in all is cut into passes of GRAPH_MAX_ROWS (each a graph replay) rather
# than run as one eager pass: the scheduler's steps beside decoding rows are 512 tokens, but a lone prompt's
# step may be 8,192 (CudaBackend.PREFILL_CHUNK_IDLE), and a prompt of 513 .. 1,024 tokens then keeps the
# two graph passes it had in 512-token steps (an eager pass of a small model's ~1k rows is host-bound).
GRAPH_SPLIT_MAX_ROWS = 2 * GRAPH_MAX_ROWS
GRAPH_CACHE = 32
VOCAB_CHUNK = 16384  # score(): lm_head rows per fp32 matmul (7B: 16384 x 3584 x 4 B = 235 MB temporary)


@dataclass
class _Graph:
    """A captured prefill pass of one shape (the pieces' row buckets, their page tables): the pieces'
    (start_pos, real rows) on the device, which it reads at each replay."""

    ctl: Any  # int32 [pieces, 2]
    graph: Any = None
    uses: int = 0


def _addr(a) -> int:
    """Device address of a CuPy array (or a host array standing in for one)."""
    ptr = getattr(getattr(a, "data", None), "ptr", None)
    return int(ptr) if ptr is not None else int(a.ctypes.data)


class PrefillPass:
    def __init__(self, dev, ks, weights: GpuWeights, cfg, k_cache, v_cache, dense: list[DenseLayer] | None = None,
                 graphs: bool = False, fp8: list[Fp8Layer] | None = None):
        """dense: every layer's matrices resident in f16 (weights.dense_layers): the GEMMs read them
        instead of dequantizing each INT4 matrix first (plan.choose_prefill_weights). graphs: replay a
        captured pass per shape of pieces (GRAPH_BUCKETS; a shape runs eagerly in the graph buffers on its
        first use and is captured on its second: cuBLAS handles, modules and workspaces exist by then)."""
        self.dev, self.ks, self.w, self.cfg = dev, ks, weights, cfg
        self.k_cache, self.v_cache = k_cache, v_cache
        self.dense = dense
        self.fp8 = fp8  # every layer's e4m3 copy (opt-in FP8 prefill), or None
        if dense is not None and fp8 is not None:
            raise ValueError("PrefillPass takes the fp16 copy or the fp8 one, not both")
        self.graphs = graphs
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()  # least recently used first
        self._gbuf: tuple | None = None  # (ids [R], x [R, H], buffers(R)) for R = GRAPH_MAX_ROWS
        self._ws = None
        self._fp8_bufs = None

    def hidden(self, token_ids: np.ndarray, start: int, page_table):
        """Final-layer hidden rows (before the final norm) of token_ids at positions start.., f16 [T,H];
        writes their K/V into the pages page_table (device int32) names."""
        return self.hidden_many([(token_ids, start, page_table)])

    def hidden_many(self, segments):
        """hidden() of several sequences' new tokens at once: segments is a list of (token_ids, start,
        page_table), one sequence each; returns their final-layer hidden rows concatenated in order,
        f16 [sum T, H].

        Rows of all segments share every GEMM (and the dequantization of each weight before it, the
        larger part of a short prompt's time: the 7B's 4.5 GB of INT4 become 18 GB of fp16 writes and
        reads per pass); RoPE + K/V write and causal attention run per segment, each over its own
        positions and pages. Passes hold at most PREFILL_CHUNK rows (GRAPH_MAX_ROWS when the call has at
        most GRAPH_SPLIT_MAX_ROWS rows and graphs are on); a longer segment is split into pieces that run
        in order (a piece's attention reads the pages its predecessors wrote)."""
        xp = self.dev.xp
        total = sum(int(ids.shape[0]) for ids, _, _ in segments)
        limit = min(PREFILL_CHUNK, GRAPH_MAX_ROWS) if self.graphs and total <= GRAPH_SPLIT_MAX_ROWS else PREFILL_CHUNK
        pieces = []  # (ids, start, page_table, row offset in the output)
        row = 0
        for ids, start, table in segments:
            T = int(ids.shape[0])
            for c0 in range(0, T, limit):
                c1 = min(T, c0 + limit)
                pieces.append((ids[c0:c1], start + c0, table, row + c0))
            row += T
        passes: list[list] = [[]]  # the pieces in order, at most `limit` rows a pass
        rows = 0
        for piece in pieces:
            n = int(piece[0].shape[0])
            if passes[-1] and rows + n > limit:
                passes.append([])
                rows = 0
            passes[-1].append(piece)
            rows += n
        out = xp.empty((row, self.cfg.hidden), dtype=np.float16)
        for group in passes:
            x, rows = self._pass(group)
            for (ids, _, _, at), r in zip(group, rows, strict=True):
                T = int(ids.shape[0])
                out[at:at + T] = x[r:r + T]
        return out

    def _pass(self, pieces):
        """One pass through the layers of the pieces' rows (<= PREFILL_CHUNK of them): (x, the row of x
        where each piece's rows begin)."""
        # Every pass that fits a graph takes the graph buffers' shape (its pieces padded to their buckets), its
        # first one too: that shape's first use runs eagerly there (_graph_pass), which is the warm-up capture
        # needs. The process's first pass once ran eagerly at its own row count instead, and a GEMM of 18 rows
        # does not round as one of 32 (cuBLAS, and numpy's BLAS in the host stand-in, block by shape), so the
        # first prompt of a process could part from the same prompt later at a near-tie (the host stand-in:
        # ~2% of seeds of test_failed_launch_leaves_backend_usable, found 2026-12-03).
        buckets = self._graph_shape(pieces) if self.graphs else None
        if buckets is not None:
            return self._graph_pass(pieces, buckets)
        dev = self.dev
        ids_host = np.concatenate([p[0] for p in pieces]).astype(np.int32)
        ids = dev.xp.empty(int(ids_host.shape[0]), dtype=np.int32)
        dev.h2d(ids, ids_host)
        x = dev.xp.empty((int(ids_host.shape[0]), self.cfg.hidden), dtype=np.float16)
        self.ks.embed(self.w.embed, ids, x)  # f16 [T,H]: the rows of the ids (the graphs' launch too)
        segs, r = [], 0
        for p_ids, start, table, _ in pieces:
            T = int(p_ids.shape[0])
            segs.append((r, r + T, start, table))
            r += T
        bufs = self.buffers(r)
        for i in range(self.cfg.n_layers):
            self.layer(i, x, segs, bufs)
        return x, [seg[0] for seg in segs]

    @staticmethod
    def _graph_shape(pieces) -> tuple[int, ...] | None:
        """Each piece's bucket of rows, when the pass fits a graph (None: it runs eagerly)."""
        buckets = []
        for p in pieces:
            T = int(p[0].shape[0])
            if T > GRAPH_BUCKETS[-1]:
                return None
            buckets.append(next(b for b in GRAPH_BUCKETS if b >= T))
        return tuple(buckets) if sum(buckets) <= GRAPH_MAX_ROWS else None

    def _graph_pass(self, pieces, buckets: tuple[int, ...]):
        """The pass in the shared graph buffers: the same launches eagerly on the shape's first use, then
        its captured graph: (x, the row where each piece begins; x is a view of the shared buffers, valid
        until the next pass)."""
        dev, xp = self.dev, self.dev.xp
        if self._gbuf is None:
            self._gbuf = (xp.zeros(GRAPH_MAX_ROWS, dtype=np.int32),
                          xp.zeros((GRAPH_MAX_ROWS, self.cfg.hidden), dtype=np.float16),
                          self.buffers(GRAPH_MAX_ROWS, zeroed=True))
        ids_all, x_all, bufs_all = self._gbuf
        rows = sum(buckets)
        offsets = [sum(buckets[:k]) for k in range(len(buckets))]
        tables = [p[2] for p in pieces]
        key = (buckets, tuple(_addr(t) for t in tables))
        g = self._graphs.get(key)
        if g is None:
            g = _Graph(xp.zeros((len(pieces), 2), dtype=np.int32))
            self._graphs[key] = g
            while len(self._graphs) > GRAPH_CACHE:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        padded = np.zeros(rows, dtype=np.int32)
        ctl = np.zeros((len(pieces), 2), dtype=np.int32)
        for k, (p_ids, start, _, _) in enumerate(pieces):
            T = int(p_ids.shape[0])
            padded[offsets[k]:offsets[k] + T] = p_ids
            ctl[k] = (start, T)
        ids, x = ids_all[:rows], x_all[:rows]
        dev.h2d(ids, padded)
        dev.h2d(g.ctl, ctl)
        g.uses += 1
        if g.graph is None:
            bufs = {name: buf[:rows] for name, buf in bufs_all.items()}
            segs = [(off, off + b, None, t) for off, b, t in zip(offsets, buckets, tables, strict=True)]
            ctls = [g.ctl[k] for k in range(len(pieces))]

            def launch_all() -> None:
                self.ks.embed(self.w.embed, ids, x)
                for i in range(self.cfg.n_layers):
                    self.layer(i, x, segs, bufs, ctls=ctls)

            if g.uses == 1:
                # A shape's first pass runs its launches eagerly: capturing costs about an eager pass plus
                # the graph's instantiation, measured +16 ms on the first 128-token prompt of the 1.5B
                # (docs/PERF.md), which only a shape that comes back repays
                launch_all()
                return x, offsets
            g.graph = dev.capture(launch_all)
        dev.replay(g.graph)
        return x, offsets

    def buffers(self, T: int, zeroed: bool = False) -> dict:
        """The per-chunk temporaries (f16, row-major): h [T,H] (not with the FP8 path), qkv [T,R], q/a [T,Q],
        act [T,I], and gu [T,2I] unless the gate|up GEMM applies the SiLU itself.
        zeroed: a graph bucket's (its padding rows of `a`, never written by attention, stay 0, so every
        padding row stays finite)."""
        xp, c = self.dev.xp, self.cfg
        H, Q, Im = c.hidden, c.q_dim, c.intermediate
        R = c.qkv_rows
        shapes = {"h": (T, H), "qkv": (T, R), "q": (T, Q), "a": (T, Q), "act": (T, Im)}
        if not self._silu_fused():  # the gate|up output, for silu_mul (7B, 8192 rows: 621 MB)
            shapes["gu"] = (T, 2 * Im)
        if self.fp8 is not None:  # the norms write e4m3 into the FP8 scratch instead
            del shapes["h"]
        new = xp.zeros if zeroed else xp.empty
        return {k: new(s, dtype=np.float16) for k, s in shapes.items()}

    def _fp8_scratch(self):
        """(xq, sx): a GEMM's X in e4m3 and its token scales (opt-in FP8), flat, sized once for a pass of
        PREFILL_CHUNK rows at the widest K (7B: 8192 x 18944 B = 155 MB): a captured graph must not allocate."""
        if self._fp8_bufs is None:
            c = self.cfg
            kmax, rows = max(c.hidden, c.q_dim, c.intermediate), max(PREFILL_CHUNK, GRAPH_MAX_ROWS)
            self._fp8_bufs = (self.dev.xp.empty(rows * kmax, dtype=np.uint8),
                              self.dev.xp.empty(rows, dtype=np.float32))
        return self._fp8_bufs

    def _silu_fused(self) -> bool:
        """The gate|up GEMM applies SiLU(gate) * up itself (gemm_int4_wg_silu): on the INT4 weights, when
        its 64-output tiles divide the intermediate size."""
        return self.dense is None and (2 * self.cfg.intermediate) % 128 == 0

    def _gemm_workspace(self):
        """fp32 scratch for the split-K partial sums of gemm_int4_wg (prefill_gemm.WORKSPACE_CAP, 64 MiB: a
        plan never asks for more), allocated once: a captured graph must not allocate."""
        if self.dev.xp is np:
            return None
        if self._ws is None:
            self._ws = self.dev.xp.empty(WORKSPACE_CAP // 4, dtype=np.float32)
        return self._ws

    def layer(self, i: int, x, segs, b: dict, ctls=None) -> None:
        """Decoder layer i over the rows of x [T,H] (updated in place); segs lists (r0, r1, start,
        page_table): rows r0..r1-1 are one sequence's tokens at positions start..start+r1-r0-1. ctls (a
        graph's): per segment a device int32 [2] = (start, real rows), the segments' starts then None."""
        if self.fp8 is not None:
            self._layer_fp8(i, x, segs, b, ctls)
            return
        ks, lw, eps = self.ks, self.w.layers[i], self.cfg.rms_eps
        dl = self.dense[i] if self.dense is not None else None
        ws = self._gemm_workspace() if dl is None else None

        def gemm(name: str, X, out, accumulate: bool = False) -> None:
            if dl is not None:  # the resident f16 copy
                ks.gemm_f16(getattr(dl, name), X, out, accumulate=accumulate)
            else:  # the INT4 matrix as stored (split-K partial sums, when the plan splits, into ws)
                w = getattr(lw, name)
                ks.gemm_int4_wg(w.qweight, w.scales, X, out, accumulate=accumulate, workspace=ws)

        ks.rmsnorm_rows(x, lw.in_norm, b["h"], eps)
        gemm("qkv", b["h"], b["qkv"])
        self._attention(i, segs, b, ctls)
        gemm("o", b["a"], x, accumulate=True)
        ks.rmsnorm_rows(x, lw.post_norm, b["h"], eps)
        if not self._silu_fused():
            gemm("gate_up", b["h"], b["gu"])
            ks.silu_mul(b["gu"], b["act"])
        else:  # SiLU(gate) * up in the GEMM's epilogue: the [T, 2I] output is never written
            ks.gemm_int4_wg_silu(lw.gate_up.qweight, lw.gate_up.scales, b["h"], b["act"])
        gemm("down", b["act"], x, accumulate=True)

    def _layer_fp8(self, i: int, x, segs, b: dict, ctls) -> None:
        """layer() on the FP8 GEMMs (opt-in): every GEMM's X in e4m3 with a scale per token, in the FP8
        scratch (the norms write it directly: rmsnorm_e4m3; o_proj's and down's inputs go through
        quantize_e4m3), times the layer's resident e4m3 copy; gate|up with SiLU(gate) * up in its epilogue."""
        ks, fl, lw, eps = self.ks, self.fp8[i], self.w.layers[i], self.cfg.rms_eps
        ws = self._gemm_workspace()
        xq_all, sx_all = self._fp8_scratch()

        def scratch(t: int, k: int):
            return xq_all[: t * k].reshape(t, k), sx_all[:t]

        T, H = (int(v) for v in x.shape)
        xq, sx = scratch(T, H)
        ks.rmsnorm_e4m3(x, lw.in_norm, xq, sx, eps)
        ks.gemm_fp8(fl.qkv.w8, fl.qkv.sw, xq, sx, b["qkv"], workspace=ws)
        self._attention(i, segs, b, ctls)
        xq, sx = scratch(*(int(v) for v in b["a"].shape))
        ks.quantize_e4m3(b["a"], xq, sx)
        ks.gemm_fp8(fl.o.w8, fl.o.sw, xq, sx, x, accumulate=True, workspace=ws)
        xq, sx = scratch(T, H)
        ks.rmsnorm_e4m3(x, lw.post_norm, xq, sx, eps)
        ks.gemm_fp8_silu(fl.gate_up.w8, fl.gate_up.sw, xq, sx, b["act"])
        xq, sx = scratch(*(int(v) for v in b["act"].shape))
        ks.quantize_e4m3(b["act"], xq, sx)
        ks.gemm_fp8(fl.down.w8, fl.down.sw, xq, sx, x, accumulate=True, workspace=ws)

    def _attention(self, i: int, segs, b: dict, ctls) -> None:
        """RoPE + K/V page write of each segment's q/k/v rows, then causal attention over its pages: b["qkv"]
        -> b["q"] -> b["a"]."""
        ks, lw = self.ks, self.w.layers[i]
        dctl = [{} if ctls is None else {"ctl": ctls[k]} for k in range(len(segs))]
        for (r0, r1, start, table), kw in zip(segs, dctl, strict=True):
            ks.rope_kv_prefill(b["qkv"][r0:r1], start, table, self.k_cache, self.v_cache, i, b["q"][r0:r1],
                               bias=lw.qkv_bias, **kw)
        for (r0, r1, start, table), kw in zip(segs, dctl, strict=True):  # after every segment's K/V is written
            ks.attention_prefill(b["q"][r0:r1], self.k_cache, self.v_cache, table, start, r1 - r0, i,
                                 b["a"][r0:r1], **kw)

    def all_logits(self, x):
        """f32 [T,V] logits of every row of x (final norm + lm_head in fp32), on the host. The lm_head is the
        fp16 matrix of the batched decode (weights.GpuWeights.lm_head: with the int8 head, its values)."""
        xp, c = self.dev.xp, self.cfg
        T = int(x.shape[0])
        h = xp.empty((T, c.hidden), dtype=np.float16)
        self.ks.rmsnorm_rows(x, self.w.final_norm, h, c.rms_eps)
        hf = h.astype(np.float32)
        out = np.empty((T, c.vocab), dtype=np.float32)
        lm = self.w.lm_head
        for v0 in range(0, c.vocab, VOCAB_CHUNK):
            v1 = min(c.vocab, v0 + VOCAB_CHUNK)
            out[:, v0:v1] = self.dev.d2h(hf @ lm[v0:v1].astype(np.float32).T)
        return out
