"""HostKernels: numpy launchers with the KernelSet's names and signatures (docs/INTERFACES.md section 4).

Not a second reference model: a stand-in that lets the backend's plumbing run on a CPU (with
device.HostDevice), so CI can check that CudaBackend feeds each launcher the right buffers, positions,
page tables and layers, and that what a CUDA graph would freeze at capture time (Python scalars) and what
it reads at replay (arrays) are what the backend assumes. Math is fp32 with fp16 storage where the GPU
stores fp16, so its rounding is the GPU's kind, not the float32 reference's.

While the HostDevice records a capture, every launcher call is appended to the recording instead of run
(arguments held as they were passed: arrays by reference, scalars by value), exactly like a CUDA graph.
"""

from __future__ import annotations

import functools

import numpy as np

from ..kv_pages import PAGE_TOKENS


def _launcher(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        rec = self.dev.recording
        if rec is not None:
            rec.append((functools.partial(fn, self), args, kwargs))
        else:
            fn(self, *args, **kwargs)

    return wrapper


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float32)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * w.astype(np.float32)


class HostKernels:
    def __init__(self, cfg, dev):
        self.cfg, self.dev = cfg, dev
        self._deq: dict[tuple[int, int], np.ndarray] = {}

    # --- weights ---
    def _w(self, qweight: np.ndarray, scales: np.ndarray) -> np.ndarray:
        """f32 [N,K] of ValueShuffle words (cached per buffer: the weights never change)."""
        key = (qweight.ctypes.data, qweight.shape[0])
        w = self._deq.get(key)
        if w is None:
            from nanoqwen_format import unpack_valueshuffle

            q = unpack_valueshuffle(np.asarray(qweight)).astype(np.float32) - 8.0  # [N,K]
            s = np.repeat(scales.astype(np.float32), 128, axis=1)  # [N,K]
            w = q * s
            self._deq[key] = w
        return w

    def _rope(self, v: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """v f32 [T, heads, 128], pos int [T]: HF rotate-half, angles in fp32 like the kernels."""
        hd = v.shape[-1]
        inv = (1.0 / (self.cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))).astype(np.float32)
        ang = pos.astype(np.float32)[:, None] * inv[None, :]
        cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
        rot = np.concatenate([-v[..., hd // 2:], v[..., : hd // 2]], axis=-1)
        return v * cos[:, None, :] + rot * sin[:, None, :]

    def _write_kv(self, k, v, pos, page_table, k_cache, v_cache, layer) -> None:
        for t, p in enumerate(pos):
            page, slot = int(page_table[p // PAGE_TOKENS]), int(p % PAGE_TOKENS)
            k_cache[layer, page, :, slot, :] = k[t]
            v_cache[layer, page, :, slot, :] = v[t]

    def _attend(self, q, k_cache, v_cache, page_table, layer, qpos, n_ctx) -> np.ndarray:
        """q f32 [T, nh, 128] at positions qpos over cached positions [0, n_ctx): causal, fp32 softmax."""
        c = self.cfg
        ctx = np.arange(n_ctx)
        pages, slots = page_table[ctx // PAGE_TOKENS], ctx % PAGE_TOKENS
        keys = k_cache[layer, pages, :, slots, :].astype(np.float32)  # [n_ctx, nkv, 128]
        vals = v_cache[layer, pages, :, slots, :].astype(np.float32)
        g = c.n_heads // c.n_kv_heads
        qg = q.reshape(q.shape[0], c.n_kv_heads, g, c.head_dim)
        s = np.einsum("tkgd,skd->kgts", qg, keys) / np.float32(np.sqrt(c.head_dim))
        s = np.where(qpos[:, None] >= ctx[None, :], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return np.einsum("kgts,skd->tkgd", p, vals).reshape(q.shape[0], c.q_dim)

    # --- decode launchers ---
    @_launcher
    def embed(self, table, token_dev, out):
        out[...] = table[int(token_dev[0])]

    @_launcher
    def rmsnorm(self, x, w, out, eps):
        out[...] = _rms(x, w, eps).astype(out.dtype)

    @_launcher
    def rmsnorm_rows(self, x, w, out, eps):
        out[...] = _rms(x, w, eps).astype(out.dtype)

    @_launcher
    def gemv_int4(self, qweight, scales, x, out, residual=None, norm_w=None, eps=1e-6):
        xin = _rms(x, norm_w, eps) if norm_w is not None else x.astype(np.float32)
        xin = xin.astype(np.float16).astype(np.float32)
        y = self._w(qweight, scales) @ xin
        if residual is not None:
            y = y + residual.astype(np.float32)
        out[...] = y.astype(out.dtype)

    @_launcher
    def qkv_rope_kv(self, qweight, scales, bias, x, norm_w, eps, pos_dev, page_table, k_cache, v_cache,
                    layer, q_out):
        c = self.cfg
        h = _rms(x, norm_w, eps).astype(np.float16).astype(np.float32)
        y = self._w(qweight, scales) @ h + bias.astype(np.float32)
        self._rope_kv(y[None, :], np.array([int(pos_dev[0])]), page_table, k_cache, v_cache, layer,
                      q_out[None, :], c)

    def _rope_kv(self, qkv, pos, page_table, k_cache, v_cache, layer, q_out, c):
        T, Q, KV = qkv.shape[0], c.q_dim, c.kv_dim
        q = self._rope(qkv[:, :Q].reshape(T, c.n_heads, c.head_dim), pos)
        k = self._rope(qkv[:, Q:Q + KV].reshape(T, c.n_kv_heads, c.head_dim), pos)
        v = qkv[:, Q + KV:].reshape(T, c.n_kv_heads, c.head_dim)
        q_out[...] = q.reshape(T, Q).astype(q_out.dtype)
        self._write_kv(k.astype(np.float16), v.astype(np.float16), pos, page_table, k_cache, v_cache, layer)

    @_launcher
    def gate_up_silu(self, qweight, scales, x, norm_w, eps, out):
        h = _rms(x, norm_w, eps).astype(np.float16).astype(np.float32)
        gu = self._w(qweight, scales) @ h
        g, u = gu[: out.shape[0]], gu[out.shape[0]:]
        out[...] = (g / (1.0 + np.exp(-g)) * u).astype(out.dtype)

    @_launcher
    def attention_decode(self, q, k_cache, v_cache, page_table, seq_len_dev, layer, out, workspace=None):
        n = int(seq_len_dev[0])
        qh = q.astype(np.float32).reshape(1, self.cfg.n_heads, self.cfg.head_dim)
        out[...] = self._attend(qh, k_cache, v_cache, page_table, layer, np.array([n - 1]), n)[0].astype(out.dtype)

    @_launcher
    def gemv_fp16(self, w, x, out):
        key = (w.ctypes.data, w.shape[0], -1)
        wf = self._deq.get(key)
        if wf is None:
            wf = self._deq[key] = w.astype(np.float32)
        out[...] = wf @ x.astype(np.float32)

    @_launcher
    def argmax(self, logits, token_out):
        token_out[0] = int(np.argmax(logits))

    def make_sampler_state(self):
        # params f32 [5]: temperature, top_k, top_p, min_p, repetition penalty; rng uint64 [2]: seed, step
        return np.zeros(5, dtype=np.float32), np.zeros(2, dtype=np.uint64)

    def set_sampler_params(self, params, rng, *, temperature, top_k, top_p, min_p, repetition_penalty, seed):
        params[...] = (temperature, top_k, top_p, min_p, repetition_penalty)
        rng[...] = (seed % 2**63, 0)

    @_launcher
    def sample(self, logits, params, rng_state, history, token_out):
        from ..params import SamplingParams
        from ..sampler import _softmax, processed_logits

        t, k, p, mp, rp = (float(v) for v in params)
        sp = SamplingParams(temperature=t, top_k=int(k), top_p=p, min_p=mp, repetition_penalty=rp)
        x = processed_logits(np.asarray(logits, np.float32), sp, history.astype(bool))
        if t == 0:
            tok = int(np.argmax(x))
        else:
            gen = np.random.default_rng([int(rng_state[0]), int(rng_state[1])])
            probs = _softmax(x)
            tok = int(gen.choice(len(probs), p=probs / probs.sum()))
        rng_state[1] += 1
        history[tok] = 1
        token_out[0] = tok

    @_launcher
    def advance(self, pos_dev, seq_len_dev):
        pos_dev[0] += 1
        seq_len_dev[0] += 1

    # --- prefill launchers ---
    @_launcher
    def gemm_int4(self, qweight, scales, X, out, workspace=None):
        out[...] = (X.astype(np.float32) @ self._w(qweight, scales).T).astype(out.dtype)

    @_launcher
    def rope_kv_prefill(self, qkv, start_pos, page_table, k_cache, v_cache, layer, q_out):
        T = qkv.shape[0]
        self._rope_kv(qkv.astype(np.float32), np.arange(start_pos, start_pos + T), page_table, k_cache,
                      v_cache, layer, q_out, self.cfg)

    @_launcher
    def attention_prefill(self, q, k_cache, v_cache, page_table, start_pos, T, layer, out):
        c = self.cfg
        qh = q.astype(np.float32).reshape(T, c.n_heads, c.head_dim)
        qpos = np.arange(start_pos, start_pos + T)
        out[...] = self._attend(qh, k_cache, v_cache, page_table, layer, qpos, start_pos + T).astype(out.dtype)
