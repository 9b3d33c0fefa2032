"""The reference backend against a deliberately naive float64 Qwen2 written here, and its cache.

The naive model shares nothing with the backend but the dequantized weights: a contiguous per-layer
list of K/V, explicit loops over positions and heads, RoPE as pairwise rotations. Its lm_head is either
the file's fp16 values or s * q of the int8 head (nanoqwen_kernels.head_i8's quantizer, the definition of
lm_head_dtype="int8").
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from nanoqwen_engine.params import SamplingParams
from nanoqwen_engine.reference import ReferenceBackend
from nanoqwen_engine.sampler import SamplerState
from nanoqwen_kernels.head_i8 import dequantize_head_i8, quantize_head_i8


class NaiveQwen2:
    def __init__(self, nq, cfg):
        self.cfg = cfg
        g = lambda n: np.asarray(nq.tensor(n), dtype=np.float64)  # noqa: E731
        self.embed = g("model.embed_tokens.weight")
        head16 = nq.tensor("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
        self.heads = {"fp16": np.asarray(head16, dtype=np.float64),
                      "int8": dequantize_head_i8(*quantize_head_i8(np.asarray(head16))).astype(np.float64)}
        self.norm = g("model.norm.weight")
        self.layers = []
        for i in range(cfg.n_layers):
            p = f"model.layers.{i}."
            d = {s: nq.dequantize(p + s + ".weight").astype(np.float64) for s in
                 ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
            for s in ("q", "k", "v"):
                d[s + "b"] = g(p + f"self_attn.{s}_proj.bias")
            d["in"] = g(p + "input_layernorm.weight")
            d["post"] = g(p + "post_attention_layernorm.weight")
            self.layers.append(d)

    def _norm(self, x, w):
        return x / math.sqrt(float(np.mean(x * x)) + self.cfg.rms_eps) * w

    def _rope(self, vec, pos):
        hd = self.cfg.head_dim
        out = vec.copy()
        for i in range(hd // 2):
            a = pos * self.cfg.rope_theta ** (-2.0 * i / hd)
            x1, x2 = vec[i], vec[i + hd // 2]
            out[i] = x1 * math.cos(a) - x2 * math.sin(a)
            out[i + hd // 2] = x2 * math.cos(a) + x1 * math.sin(a)
        return out

    def logits(self, ids, lm_head_dtype):
        """float64 [T, V], one position at a time, through the lm_head of `lm_head_dtype`."""
        c = self.cfg
        hd = c.head_dim
        cache = [([], []) for _ in range(c.n_layers)]  # per layer: list of k [n_kv, hd], v [n_kv, hd]
        rows = []
        for pos, tok in enumerate(ids):
            x = self.embed[tok].copy()
            for li, L in enumerate(self.layers):
                h = self._norm(x, L["in"])
                q = (L["self_attn.q_proj"] @ h + L["qb"]).reshape(c.n_heads, hd)
                k = (L["self_attn.k_proj"] @ h + L["kb"]).reshape(c.n_kv_heads, hd)
                v = (L["self_attn.v_proj"] @ h + L["vb"]).reshape(c.n_kv_heads, hd)
                q = np.stack([self._rope(q[j], pos) for j in range(c.n_heads)])
                k = np.stack([self._rope(k[j], pos) for j in range(c.n_kv_heads)])
                cache[li][0].append(k)
                cache[li][1].append(v)
                att = np.zeros((c.n_heads, hd))
                for j in range(c.n_heads):
                    kv = j * c.n_kv_heads // c.n_heads
                    s = np.array([q[j] @ kk[kv] for kk in cache[li][0]]) / math.sqrt(hd)
                    w = np.exp(s - s.max())
                    w /= w.sum()
                    for t, vv in enumerate(cache[li][1]):
                        att[j] += w[t] * vv[kv]
                x = x + L["self_attn.o_proj"] @ att.reshape(-1)
                h = self._norm(x, L["post"])
                gate = L["mlp.gate_proj"] @ h
                x = x + L["mlp.down_proj"] @ (gate / (1 + np.exp(-gate)) * (L["mlp.up_proj"] @ h))
            rows.append(self.heads[lm_head_dtype] @ self._norm(x, self.norm))
        return np.stack(rows)


def rel_err(a, b) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def naive_cache():
    return {}


@pytest.fixture(scope="module")
def tied_backend(tied_path, open_file):
    """One backend for the cache tests (tied model: 2 KV heads, fast lm_head); each test frees its pages."""
    nq, cfg = open_file(tied_path)
    backend = ReferenceBackend.create(nq, cfg, max_context=64)
    yield backend, cfg
    assert backend.pool.n_free == backend.pool.n_pages


@pytest.mark.parametrize("lm_head_dtype", ["int8", "fp16"])
def test_reference_matches_naive_float64(model_path, open_file, naive_cache, rng, lm_head_dtype):
    nq, cfg = open_file(model_path)
    ids = rng.integers(0, cfg.vocab, size=21)
    backend = ReferenceBackend.create(nq, cfg, max_context=64, lm_head_dtype=lm_head_dtype)
    got = backend.score(ids)
    naive = naive_cache.setdefault(model_path, NaiveQwen2(nq, cfg))
    want = naive.logits(ids, lm_head_dtype)
    assert got.shape == (21, cfg.vocab) and got.dtype == np.float32
    assert rel_err(got, want) < 1e-4
    assert backend.pool.n_free == backend.pool.n_pages  # score gave its pages back


@pytest.mark.parametrize("n_prompt", [1, 15, 16, 17, 31, 32, 33])
def test_prefill_then_decode_equals_scoring_at_once(tied_backend, n_prompt, rng):
    """The cache is right: a prompt prefilled, then tokens decoded one by one across page boundaries
    (15/16/17, 31/32/33), gives the logits of scoring the whole sequence in one pass."""
    backend, cfg = tied_backend
    n_total = 40
    ids = rng.integers(0, cfg.vocab, size=n_total)
    want = backend.score(ids)
    seq = backend.pool.new_sequence()
    sampler = SamplerState(SamplingParams(temperature=0).resolve({}), cfg.vocab)
    backend.prefill(seq, ids[:n_prompt], sampler)
    rows = [backend.last_logits()[0].copy()]
    for t in ids[n_prompt:]:
        backend.decode([seq], [int(t)], [sampler])
        rows.append(backend.last_logits()[0].copy())
    assert seq.length == n_total and seq.n_pages == 3
    got = np.stack(rows)
    np.testing.assert_allclose(got, want[n_prompt - 1 :], rtol=0, atol=1e-4 * np.abs(want).max())
    # And the pages the sequence holds carry exactly the K written for each position.
    page, slot = seq.slot_of(n_total - 1)
    assert np.abs(backend.k_cache[0, page, :, slot]).sum() > 0
    backend.pool.free(seq)


def test_fp16_cache_stays_close(tiny_path, open_file, rng):
    """kv_dtype=float16 stores what the GPU stores; logits move by fp16 rounding only."""
    nq, cfg = open_file(tiny_path)
    ids = rng.integers(0, cfg.vocab, size=20)
    a = ReferenceBackend.create(nq, cfg, max_context=32).score(ids)
    b = ReferenceBackend.create(nq, cfg, max_context=32, kv_dtype=np.float16).score(ids)
    assert 0 < rel_err(b, a) < 1e-2


def test_lazy_weights_give_the_same_logits(tied_path, open_file, rng):
    """A budget smaller than the projections (the 7B path) dequantizes per layer on use, same numbers."""
    nq, cfg = open_file(tied_path)
    ids = rng.integers(0, cfg.vocab, size=9)
    full = ReferenceBackend.create(nq, cfg, max_context=32)
    one_layer = full.weights.layer(0).nbytes
    for budget, kept in ((1, 0), (one_layer, 1), (2 * one_layer + 1, 2)):
        lazy = ReferenceBackend.create(nq, cfg, max_context=32, weight_budget=budget)
        assert lazy.weights.lazy and not full.weights.lazy
        np.testing.assert_array_equal(lazy.score(ids), full.score(ids))
        assert sorted(lazy.weights._layers) == list(range(kept))  # the first layers that fit stay


def test_attention_in_query_chunks_equals_one_block(tied_backend, monkeypatch, rng):
    import nanoqwen_engine.reference.backend as rb

    backend, cfg = tied_backend
    ids = rng.integers(0, cfg.vocab, size=30)
    whole = backend.score(ids)
    monkeypatch.setattr(rb, "Q_CHUNK", 7)  # 30 rows: blocks of 7, 7, 7, 7, 2
    np.testing.assert_allclose(backend.score(ids), whole, rtol=0, atol=1e-5 * np.abs(whole).max())
