"""ReferenceBackend: the Qwen2 forward in numpy float32 over the paged KV cache (the oracle).

Per layer, for T new tokens at positions start..start+T-1 of a sequence:

  x [T,H] -> RMSNorm -> q,k,v (+bias) -> RoPE(q,k) -> write k,v into the sequence's pages
          -> GQA attention of q over the pages' keys 0..start+T-1 (causal) -> o_proj -> + x
          -> RMSNorm -> silu(gate) * up -> down_proj -> + x

then the final RMSNorm and lm_head. The cache arrays have exactly the GPU layout of kv_pages.py
(`[n_layers, n_pages, n_kv_heads, 16, head_dim]`), float32 by default so the oracle is not rounded to
fp16; `kv_dtype=np.float16` stores what the GPU stores.
"""

from __future__ import annotations

import time

import numpy as np

from ..config import ModelConfig
from ..kv_pages import PAGE_TOKENS, PagePool, SequenceState, kv_cache_shape, pages_for
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
    def __init__(self, nqfile, config: ModelConfig, max_context: int, n_pages: int, kv_dtype, weight_budget: int):
        t0 = time.perf_counter()
        self.config = config
        self.max_context = max_context
        self.weights = ReferenceWeights(nqfile, config, budget=weight_budget)
        self.pool = PagePool(n_pages, pages_for(max_context))
        shape = kv_cache_shape(config.n_layers, n_pages, config.n_kv_heads, config.head_dim)
        # np.zeros maps untouched memory lazily, so a large pool costs only the pages written.
        self.k_cache = np.zeros(shape, dtype=kv_dtype)  # [L, n_pages, n_kv, 16, hd]
        self.v_cache = np.zeros(shape, dtype=kv_dtype)  # [L, n_pages, n_kv, 16, hd]
        self._last = np.zeros(config.vocab, dtype=np.float32)  # f32 [V]
        self.info = {
            "device": "cpu (numpy float32 reference)",
            "load_s": time.perf_counter() - t0,
            "weights_bytes": self.weights.resident_bytes,
            "weights_lazy": self.weights.lazy,
            "kv_bytes": self.k_cache.nbytes + self.v_cache.nbytes,
            "kv_pages": n_pages,
            "workspace_bytes": 0,
            "max_context": max_context,
        }

    @classmethod
    def create(cls, nqfile, config: ModelConfig, max_context: int | None = None, n_pages: int | None = None,
               kv_dtype=np.float32, weight_budget: int = DEFAULT_BUDGET, progress: bool = False) -> ReferenceBackend:
        """max_context: tokens per sequence (default the model's max_position_embeddings, capped at 32768).
        n_pages: pool size (default: one full-length sequence plus one spare full-length one for score)."""
        if max_context is None:
            max_context = min(config.max_position, 32768)
        if n_pages is None:
            n_pages = 2 * pages_for(max_context)
        return cls(nqfile, config, max_context, n_pages, kv_dtype, weight_budget)

    # -- the Backend protocol (docs/INTERFACES.md section 5) --

    def prefill(self, seq: SequenceState, token_ids: np.ndarray, sampler: SamplerState) -> int:
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        logits = self.forward(seq, ids, all_logits=False)
        self._last = logits[-1]
        sampler.observe(ids)
        return sampler.sample(self._last)

    def decode(self, seq: SequenceState, token_id: int, sampler: SamplerState) -> int:
        logits = self.forward(seq, np.array([token_id], dtype=np.int64), all_logits=False)
        self._last = logits[-1]
        sampler.observe([token_id])
        return sampler.sample(self._last)

    def score(self, token_ids: np.ndarray) -> np.ndarray:
        """float32 [len, vocab]: logits after each prefix, teacher-forced, in a temporary sequence."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        seq = self.pool.new_sequence()
        try:
            return self.forward(seq, ids, all_logits=True)
        finally:
            self.pool.free(seq)

    def last_logits(self) -> np.ndarray:
        return self._last

    # -- the forward --

    def forward(self, seq: SequenceState, ids: np.ndarray, all_logits: bool) -> np.ndarray:
        """Run ids [T] at positions seq.length.. ; writes K/V pages, advances seq.length.

        Returns float32 [T, V] logits (all_logits) or [1, V] for the last token.
        """
        cfg = self.config
        T = len(ids)
        start = seq.length
        if T == 0:
            raise ValueError("forward needs at least one token")
        if ids.min() < 0 or ids.max() >= cfg.vocab:
            raise ValueError(f"token id out of range 0..{cfg.vocab - 1}")
        self.pool.grow(seq, start + T)  # all-or-nothing: raises before anything is written
        end = start + T
        pos = np.arange(start, end)
        cos, sin = rope_tables(pos, cfg.head_dim, cfg.rope_theta)
        # Where each position lives: page id and slot, for the new tokens and for the whole context.
        pages_all = seq.page_table[np.arange(end) // PAGE_TOKENS]  # int32 [end]
        slots_all = np.arange(end) % PAGE_TOKENS  # [end]
        new_pages, new_slots = pages_all[start:], slots_all[start:]
        causal = pos[:, None] >= np.arange(end)[None, :]  # bool [T, end]
        group = cfg.n_heads // cfg.n_kv_heads
        scale = np.float32(1.0 / np.sqrt(cfg.head_dim))

        x = self.weights.embed_rows(ids)  # f32 [T, H]
        for li in range(cfg.n_layers):
            w = self.weights.layer(li)
            h = rmsnorm(x, w.in_norm, cfg.rms_eps)
            q = (linear(h, w.q) + w.q_bias).reshape(T, cfg.n_heads, cfg.head_dim)
            k = (linear(h, w.k) + w.k_bias).reshape(T, cfg.n_kv_heads, cfg.head_dim)
            v = (linear(h, w.v) + w.v_bias).reshape(T, cfg.n_kv_heads, cfg.head_dim)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            # cache[l, page, head, slot, :] <- k[t, head, :]
            self.k_cache[li, new_pages, :, new_slots, :] = k
            self.v_cache[li, new_pages, :, new_slots, :] = v
            keys = self.k_cache[li, pages_all, :, slots_all, :].astype(np.float32)  # [end, n_kv, hd]
            vals = self.v_cache[li, pages_all, :, slots_all, :].astype(np.float32)  # [end, n_kv, hd]
            # GQA: query head j reads KV head j // group. Queries in chunks bound the score matrix.
            qg = q.reshape(T, cfg.n_kv_heads, group, cfg.head_dim)
            attn = np.empty((T, cfg.q_dim), dtype=np.float32)
            for a in range(0, T, Q_CHUNK):
                b = min(T, a + Q_CHUNK)
                s = np.einsum("tkgd,skd->kgts", qg[a:b], keys) * scale  # [n_kv, group, b-a, end]
                s = np.where(causal[a:b], s, -np.inf)
                s = s - s.max(axis=-1, keepdims=True)
                p = np.exp(s)
                p /= p.sum(axis=-1, keepdims=True)
                attn[a:b] = np.einsum("kgts,skd->tkgd", p, vals).reshape(b - a, cfg.q_dim)
            x = x + linear(attn, w.o)
            h = rmsnorm(x, w.post_norm, cfg.rms_eps)
            g = linear(h, w.gate)
            with np.errstate(over="ignore"):  # exp(-g) -> inf for very negative g gives silu = -0, correct
                act = g / (1.0 + np.exp(-g))
            x = x + linear(act * linear(h, w.up), w.down)
        seq.length = end
        h = rmsnorm(x if all_logits else x[-1:], self.weights.final_norm, cfg.rms_eps)
        return self.weights.logits(h)
