"""Prefill on the GPU: the whole prompt through the GEMM path, filling the sequence's KV pages.

Per layer, for T prompt rows at positions start .. start+T-1 (H hidden, R = (n_heads + 2 n_kv) * 128,
Q = n_heads * 128, I intermediate; every activation f16, row-major):

    x [T,H] --rmsnorm_rows--> h [T,H] --gemm_int4 qkv + bias--> qkv [T,R]
        --rope_kv_prefill--> q [T,Q] (+ K/V of the T rows written into their pages)
        --attention_prefill (causal over [0, start+T))--> a [T,Q] --gemm_int4 o--> x += o
    x --rmsnorm_rows--> h --gemm_int4 gate|up--> gu [T,2I] --silu(gate)*up--> act [T,I]
        --gemm_int4 down--> x += d

Long prompts go through in chunks of PREFILL_CHUNK rows: each chunk is a prefill at a later start
position whose attention also reads the pages the earlier chunks wrote, so the temporaries stay bounded
(7B, 4096 rows: gu is 4096 x 37888 x 2 B = 310 MB) whatever the prompt length.
"""

from __future__ import annotations

import functools

import numpy as np

PREFILL_CHUNK = 4096
VOCAB_CHUNK = 16384  # score(): lm_head rows per fp32 matmul (7B: 16384 x 3584 x 4 B = 235 MB temporary)


@functools.cache
def _silu_mul_kernel():
    import cupy

    # One pass over gate|up instead of five (astype, exp, divide, multiply, astype).
    return cupy.ElementwiseKernel(
        "T g, T u", "T out",
        "const float gf = (float)g; out = (T)(gf / (1.0f + expf(-gf)) * (float)u);",
        "nanoqwen_silu_mul",
    )


def silu_mul(xp, gu, inter: int, out) -> None:
    """out[T,I] = silu(gu[:, :I]) * gu[:, I:], computed in fp32."""
    g, u = gu[:, :inter], gu[:, inter:]
    if xp is np:
        gf = g.astype(np.float32)
        out[...] = (gf / (1.0 + np.exp(-gf)) * u.astype(np.float32)).astype(out.dtype)
    else:
        _silu_mul_kernel()(g, u, out)


class PrefillPass:
    def __init__(self, dev, ks, weights: dict, cfg, k_cache, v_cache):
        self.dev, self.ks, self.w, self.cfg = dev, ks, weights, cfg
        self.k_cache, self.v_cache = k_cache, v_cache

    def hidden(self, token_ids: np.ndarray, start: int, page_table):
        """Final-layer hidden rows (before the final norm) of token_ids at positions start.., f16 [T,H];
        writes their K/V into the pages page_table (device int32) names."""
        xp, T = self.dev.xp, int(token_ids.shape[0])
        out = xp.empty((T, self.cfg.hidden), dtype=np.float16)
        for c0 in range(0, T, PREFILL_CHUNK):
            c1 = min(T, c0 + PREFILL_CHUNK)
            out[c0:c1] = self._chunk(token_ids[c0:c1], start + c0, page_table)
        return out

    def _chunk(self, ids_host: np.ndarray, start: int, page_table):
        dev, ks, w, c = self.dev, self.ks, self.w, self.cfg
        xp, T, eps = dev.xp, int(ids_host.shape[0]), c.rms_eps
        H, Q, Im = c.hidden, c.q_dim, c.intermediate
        R = Q + 2 * c.kv_dim
        ids = xp.empty(T, dtype=np.int32)
        dev.h2d(ids, ids_host.astype(np.int32))
        x = w["embed"][ids]  # f16 [T,H] (row gather)
        h = xp.empty((T, H), dtype=np.float16)
        qkv = xp.empty((T, R), dtype=np.float16)
        q = xp.empty((T, Q), dtype=np.float16)
        a = xp.empty((T, Q), dtype=np.float16)
        o = xp.empty((T, H), dtype=np.float16)
        gu = xp.empty((T, 2 * Im), dtype=np.float16)
        act = xp.empty((T, Im), dtype=np.float16)
        for i in range(c.n_layers):
            ks.rmsnorm_rows(x, w[f"{i}.ln1"], h, eps)
            ks.gemm_int4(w[f"{i}.qkv.w"], w[f"{i}.qkv.s"], h, qkv)
            qkv += w[f"{i}.qkv.b"]
            ks.rope_kv_prefill(qkv, start, page_table, self.k_cache, self.v_cache, i, q)
            ks.attention_prefill(q, self.k_cache, self.v_cache, page_table, start, T, i, a)
            ks.gemm_int4(w[f"{i}.o.w"], w[f"{i}.o.s"], a, o)
            x += o
            ks.rmsnorm_rows(x, w[f"{i}.ln2"], h, eps)
            ks.gemm_int4(w[f"{i}.gu.w"], w[f"{i}.gu.s"], h, gu)
            silu_mul(xp, gu, Im, act)
            ks.gemm_int4(w[f"{i}.down.w"], w[f"{i}.down.s"], act, o)
            x += o
        return x

    def all_logits(self, x):
        """f32 [T,V] logits of every row of x (final norm + lm_head in fp32), on the host."""
        xp, c = self.dev.xp, self.cfg
        T = int(x.shape[0])
        h = xp.empty((T, c.hidden), dtype=np.float16)
        self.ks.rmsnorm_rows(x, self.w["norm"], h, c.rms_eps)
        hf = h.astype(np.float32)
        out = np.empty((T, c.vocab), dtype=np.float32)
        lm = self.w["lm_head"]
        for v0 in range(0, c.vocab, VOCAB_CHUNK):
            v1 = min(c.vocab, v0 + VOCAB_CHUNK)
            out[:, v0:v1] = self.dev.d2h(hf @ lm[v0:v1].astype(np.float32).T)
        return out
