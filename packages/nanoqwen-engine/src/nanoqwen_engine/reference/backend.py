"""ReferenceBackend: the Qwen2 forward in numpy float32 over the paged KV cache (the oracle).

One forward serves prefill and batched decode: it runs a list of segments, each a run of new tokens
of one sequence (a prefill chunk is one segment of T tokens; a decode step is B segments of one token
each, one per sequence). The segments' rows are stacked into one [T_total, H] matrix, so every
projection is one matmul over all rows (for decode, [B, H] @ W.T reads each weight once per step for
the whole batch, as the GPU's batched GEMV does); only attention is per segment, over its own sequence's
pages. Per layer, for T new tokens at positions start..start+T-1 of a sequence:

  x [T,H] -> RMSNorm -> q,k,v (+bias) -> RoPE(q,k) -> write k,v into the sequence's pages
          -> GQA attention of q over the pages' keys 0..start+T-1 (causal) -> o_proj -> + x
          -> RMSNorm -> silu(gate) * up -> down_proj -> + x

then the final RMSNorm and lm_head (int8 by default, the values the GPU multiplies: weights.py). The
cache arrays have exactly the GPU layout of kv_pages.py (`[n_layers, n_pages, n_kv_heads, 16, head_dim]`),
float32 by default so the oracle is not rounded to fp16; `kv_dtype=np.float16` stores what the GPU stores.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from ..config import ModelConfig
from ..errors import InvalidRequestError
from ..kv_pages import PAGE_TOKENS, PagePool, SequenceState, kv_cache_shape, pages_for
from ..lm_head import lm_head_dtype_arg
from ..sampler import SamplerState
from .weights import DEFAULT_BUDGET, ReferenceWeights

# Query rows per attention block: the score matrix of a block is n_heads x Q_CHUNK x context float32
# (28 x 256 x 32768 x 4 B = 0.9 GiB at a full 7B context).
Q_CHUNK = 256


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """HF Qwen2RMSNorm: x * rsqrt(mean(x^2) + eps) * w, in float32."""
    var = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(var + np.float32(eps))) * w


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [T, K] @ w[N, K].T -> [T, N]. One token goes through gemv (w @ x): on the 2-core CI machine under
    load, OpenBLAS's threaded gemm with T=1 took 7.1 ms for a 4096x512 head, gemv 0.54 ms (measured)."""
    if x.shape[0] == 1:
        return (w @ x[0])[None, :]
    return x @ w.T


def rope_tables(positions: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [T, head_dim] for HF's rotate-half convention (frequencies repeated twice)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))  # [hd/2]
    ang = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, hd/2]
    emb = np.concatenate([ang, ang], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, heads, hd]; out = x*cos + rotate_half(x)*sin, rotate_half(x) = cat(-x2, x1)."""
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


class ReferenceBackend:
    def __init__(self, nqfile, config: ModelConfig, max_context: int, n_pages: int, kv_dtype, weight_budget: int,
                 lm_head_dtype: str = "int8"):
        t0 = time.perf_counter()
        self.config = config
        self.max_context = max_context
        self.weights = ReferenceWeights(nqfile, config, budget=weight_budget, lm_head_dtype=lm_head_dtype)
        self.pool = PagePool(n_pages, pages_for(max_context))
        shape = kv_cache_shape(config.n_layers, n_pages, config.n_kv_heads, config.head_dim)
        # np.zeros maps untouched memory lazily, so a large pool costs only the pages written.
        self.k_cache = np.zeros(shape, dtype=kv_dtype)  # [L, n_pages, n_kv, 16, hd]
        self.v_cache = np.zeros(shape, dtype=kv_dtype)  # [L, n_pages, n_kv, 16, hd]
        self._last = np.zeros((1, config.vocab), dtype=np.float32)  # f32 [B, V] of the last call
        self.info = {
            "device": "cpu (numpy float32 reference)",
            "load_s": time.perf_counter() - t0,
            "weights_bytes": self.weights.resident_bytes,
            "weights_lazy": self.weights.lazy,
            "kv_bytes": self.k_cache.nbytes + self.v_cache.nbytes,
            "kv_pages": n_pages,
            "workspace_bytes": 0,
            "max_context": max_context,
            "lm_head_dtype": lm_head_dtype,
            "lm_head_i8_bytes": self.weights.head_i8_bytes,
        }

    @classmethod
    def create(cls, nqfile, config: ModelConfig, max_context: int | None = None, n_pages: int | None = None,
               kv_dtype=np.float32, weight_budget: int = DEFAULT_BUDGET, progress: bool = False,
               lm_head_dtype: str | None = None) -> ReferenceBackend:
        """max_context: tokens per sequence (default the model's max_position_embeddings, capped at 32768).
        n_pages: pool size (default: one full-length sequence plus one spare full-length one for score).
        lm_head_dtype: "int8" (default: $NANOQWEN_LM_HEAD_DTYPE, else int8) or "fp16", as the GPU backend's
        (nanoqwen_engine.lm_head); anything else is an InvalidRequestError."""
        head = lm_head_dtype_arg(lm_head_dtype)
        if max_context is None:
            max_context = min(config.max_position, 32768)
        if n_pages is None:
            n_pages = 2 * pages_for(max_context)
        return cls(nqfile, config, max_context, n_pages, kv_dtype, weight_budget, head)

    # -- the Backend protocol (docs/INTERFACES.md section 6) --

    def prefill(self, seq: SequenceState, token_ids: np.ndarray, sampler: SamplerState | None) -> int | None:
        """K/V of token_ids at positions seq.length.. (a whole prompt or one chunk of it); the next id
        sampled from the last position's logits when `sampler` is given (the prompt's last chunk)."""
        ids = self._ids(token_ids)
        self._last = self.forward([(seq, ids)], all_logits=False)
        if sampler is None:
            return None
        sampler.observe(ids)
        return sampler.sample(self._last[0])

    def prefill_many(self, items: Sequence[tuple[SequenceState, np.ndarray, SamplerState | None]]
                     ) -> list[int | None]:
        """prefill() of each item in turn (the reference computes sequence by sequence anyway), after
        checking them all: ids, distinct sequences, and pages for every one (nothing changes if any fails)."""
        if len({seq.seq_id for seq, _, _ in items}) != len(items):
            raise InvalidRequestError("prefill_many got the same sequence twice")
        checked = [(seq, self._ids(ids), sampler) for seq, ids, sampler in items]
        self.pool.grow_many([(seq, seq.length + len(ids)) for seq, ids, _ in checked])
        return [self.prefill(seq, ids, sampler) for seq, ids, sampler in checked]

    def decode(self, seqs: Sequence[SequenceState], token_ids: Sequence[int],
               samplers: Sequence[SamplerState], run_ahead: bool = False) -> list[int]:
        """One batched step: row b feeds token_ids[b] to seqs[b] and samples with samplers[b]. run_ahead
        (Backend.decode's hint) changes nothing here: the reference computes each step when asked."""
        if not len(seqs) == len(token_ids) == len(samplers) or not seqs:
            raise InvalidRequestError(f"decode needs one token and one sampler per sequence, got "
                                      f"{len(seqs)} sequences, {len(token_ids)} tokens, {len(samplers)} samplers")
        if len({s.seq_id for s in seqs}) != len(seqs):
            raise InvalidRequestError("decode got the same sequence twice in one batch")
        ids = self._ids(token_ids)
        self._last = self.forward([(s, ids[b : b + 1]) for b, s in enumerate(seqs)], all_logits=False)
        out = []
        for b, sampler in enumerate(samplers):
            sampler.observe(ids[b : b + 1])
            out.append(sampler.sample(self._last[b]))
        return out

    def score(self, token_ids: np.ndarray) -> np.ndarray:
        """float32 [len, vocab]: logits after each prefix, teacher-forced, in a temporary sequence."""
        ids = self._ids(token_ids)
        seq = self.pool.new_sequence()
        try:
            return self.forward([(seq, ids)], all_logits=True)
        finally:
            self.pool.free(seq)

    def last_logits(self) -> np.ndarray:
        """float32 [B, V] of the last decode step, [1, V] after a prefill."""
        return self._last

    def _ids(self, token_ids) -> np.ndarray:
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise InvalidRequestError(f"token ids must be a non-empty 1-D integer array, got {ids.dtype} {ids.shape}")
        ids = ids.astype(np.int64)
        if ids.min() < 0 or ids.max() >= self.config.vocab:
            raise InvalidRequestError(f"token id out of range 0..{self.config.vocab - 1}")
        return ids

    # -- the forward --

    def forward(self, segments: Sequence[tuple[SequenceState, np.ndarray]], all_logits: bool) -> np.ndarray:
        """Run each segment's ids [T_i] at positions seq.length.. of its sequence; writes their K/V pages
        and advances each seq.length.

        Every sequence grows first, all-or-nothing across the segments: if any lacks pages, the ones
        already grown are shrunk back and KVPagesExhaustedError propagates with nothing changed.
        Returns float32 logits: [sum T_i, V] (all_logits) or [n_segments, V], the last row of each.
        """
        cfg = self.config
        self._grow_all(segments)
        rows: list[_Rows] = []
        offset = 0
        for seq, ids in segments:
            rows.append(_Rows(seq, seq.length, len(ids), offset))
            offset += len(ids)
        ids_all = np.concatenate([ids for _, ids in segments])
        pos = np.concatenate([np.arange(r.start, r.start + r.n) for r in rows])
        cos, sin = rope_tables(pos, cfg.head_dim, cfg.rope_theta)
        group = cfg.n_heads // cfg.n_kv_heads
        scale = np.float32(1.0 / np.sqrt(cfg.head_dim))
        T = len(ids_all)

        x = self.weights.embed_rows(ids_all)  # f32 [T, H]
        for li in range(cfg.n_layers):
            w = self.weights.layer(li)
            h = rmsnorm(x, w.in_norm, cfg.rms_eps)
            q = (linear(h, w.q) + w.q_bias).reshape(T, cfg.n_heads, cfg.head_dim)
            k = (linear(h, w.k) + w.k_bias).reshape(T, cfg.n_kv_heads, cfg.head_dim)
            v = (linear(h, w.v) + w.v_bias).reshape(T, cfg.n_kv_heads, cfg.head_dim)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            attn = np.empty((T, cfg.q_dim), dtype=np.float32)
            for r in rows:
                sl = slice(r.offset, r.offset + r.n)
                # cache[l, page, head, slot, :] <- k[t, head, :]
                self.k_cache[li, r.new_pages, :, r.new_slots, :] = k[sl]
                self.v_cache[li, r.new_pages, :, r.new_slots, :] = v[sl]
                keys = self.k_cache[li, r.pages_all, :, r.slots_all, :].astype(np.float32)  # [end, n_kv, hd]
                vals = self.v_cache[li, r.pages_all, :, r.slots_all, :].astype(np.float32)  # [end, n_kv, hd]
                # GQA: query head j reads KV head j // group. Queries in chunks bound the score matrix.
                qg = q[sl].reshape(r.n, cfg.n_kv_heads, group, cfg.head_dim)
                for a in range(0, r.n, Q_CHUNK):
                    b = min(r.n, a + Q_CHUNK)
                    s = np.einsum("tkgd,skd->kgts", qg[a:b], keys) * scale  # [n_kv, group, b-a, end]
                    s = np.where(r.causal[a:b], s, -np.inf)
                    s = s - s.max(axis=-1, keepdims=True)
                    p = np.exp(s)
                    p /= p.sum(axis=-1, keepdims=True)
                    attn[r.offset + a : r.offset + b] = np.einsum("kgts,skd->tkgd", p, vals).reshape(b - a, cfg.q_dim)
            x = x + linear(attn, w.o)
            h = rmsnorm(x, w.post_norm, cfg.rms_eps)
            g = linear(h, w.gate)
            with np.errstate(over="ignore"):  # exp(-g) -> inf for very negative g gives silu = -0, correct
                act = g / (1.0 + np.exp(-g))
            x = x + linear(act * linear(h, w.up), w.down)
        for r in rows:
            r.seq.length = r.start + r.n
        if not all_logits:
            x = x[[r.offset + r.n - 1 for r in rows]]
        return self.weights.logits(rmsnorm(x, self.weights.final_norm, cfg.rms_eps))

    def _grow_all(self, segments: Sequence[tuple[SequenceState, np.ndarray]]) -> None:
        """pool.grow for every segment, all-or-nothing across them."""
        before = [(seq, seq.n_pages) for seq, _ in segments]
        try:
            for seq, ids in segments:
                self.pool.grow(seq, seq.length + len(ids))
        except Exception:
            for seq, n in before:
                self.pool.shrink(seq, n)
            raise


class _Rows:
    """Where one segment's rows live: in the stacked batch (offset, n) and in the cache (pages, slots)."""

    def __init__(self, seq: SequenceState, start: int, n: int, offset: int):
        self.seq, self.start, self.n, self.offset = seq, start, n, offset
        end = start + n
        self.pages_all = seq.page_table[np.arange(end) // PAGE_TOKENS]  # int32 [end]
        self.slots_all = np.arange(end) % PAGE_TOKENS  # [end]
        self.new_pages, self.new_slots = self.pages_all[start:], self.slots_all[start:]
        self.causal = np.arange(start, end)[:, None] >= np.arange(end)[None, :]  # bool [n, end]
