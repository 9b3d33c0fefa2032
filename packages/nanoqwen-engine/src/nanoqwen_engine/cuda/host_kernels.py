"""HostKernels: numpy launchers with the KernelSet's names and batched signatures (docs/INTERFACES.md
section 4; activations [B, ...], a 1-D activation being B = 1).

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
from nanoqwen_kernels import head_i8 as h8
from nanoqwen_kernels import prefill_fp8 as f8
from nanoqwen_kernels.errors import KernelError

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


def _rows(a: np.ndarray) -> np.ndarray:
    """[B, n] view of a batch-shaped array (a 1-D one is B = 1); writes through it land in `a`."""
    return a.reshape(-1, a.shape[-1])


def _mm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [B, K] @ w[N, K].T; one row through gemv (OpenBLAS's threaded gemm with one row is ~10x slower
    on a busy 2-core machine: the same choice as reference/backend.py's `linear`)."""
    return (w @ x[0])[None, :] if x.shape[0] == 1 else x @ w.T


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float32)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * w.astype(np.float32)


def _silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u in the inputs' float type (the MLP activation every kernel that computes it uses)."""
    return g / (1.0 + np.exp(-g)) * u


class HostKernels:
    def __init__(self, cfg, dev, gemv_variant: str = "tiles"):
        """gemv_variant: the KernelSet GEMV variant this stands in for; "a8" rounds a single row's GEMV
        activation to int8 as the int8-activation loop does (nanoqwen_kernels.a8.round_a8)."""
        self.cfg, self.dev = cfg, dev
        self.gemv_variant = gemv_variant
        self.long_calls = 0  # attention_decode_long's calls (the tests ask which build a step ran)
        self.short_calls = 0  # attention_decode_short's
        self._deq: dict[tuple, np.ndarray] = {}

    def _gemv_x(self, xin: np.ndarray) -> np.ndarray:
        """The activation a decode GEMV multiplies: fp16 values, int8-rounded for one row under "a8"."""
        xin = xin.astype(np.float16).astype(np.float32)
        if self.gemv_variant == "a8" and xin.shape[0] == 1:
            from nanoqwen_kernels.a8 import round_a8

            return round_a8(xin)
        return xin

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

    # --- decode launchers (batched) ---
    @_launcher
    def embed(self, table, token_dev, out):
        _rows(out)[...] = table[np.asarray(token_dev, dtype=np.int64)]

    @_launcher
    def rmsnorm(self, x, w, out, eps):
        _rows(out)[...] = _rms(_rows(x), w, eps).astype(out.dtype)

    @_launcher
    def rmsnorm_rows(self, x, w, out, eps):
        out[...] = _rms(x, w, eps).astype(out.dtype)

    @_launcher
    def gemv_int4(self, qweight, scales, x, out, residual=None, norm_w=None, eps=1e-6, x_a8_image=False):
        if x_a8_image:  # x's storage holds down_proj's a8 image (gate_up_silu's a8_image output)
            from nanoqwen_kernels.a8 import a8_image_values

            xv = a8_image_values(np.asarray(x).reshape(-1).view(np.uint8), qweight.shape[1] * 8)[None, :]
        else:
            xr = _rows(x)
            xv = self._gemv_x(_rms(xr, norm_w, eps) if norm_w is not None else xr.astype(np.float32))
        y = _mm(xv, self._w(qweight, scales))
        if residual is not None:
            y = y + _rows(residual).astype(np.float32)
        _rows(out)[...] = y.astype(out.dtype)

    @_launcher
    def qkv_rope_kv(self, qweight, scales, bias, x, norm_w, eps, pos_dev, page_table, k_cache, v_cache,
                    layer, q_out, settled=False):
        c = self.cfg
        h = self._gemv_x(_rms(_rows(x), norm_w, eps))
        y = _mm(h, self._w(qweight, scales)) + bias.astype(np.float32)  # [B, R]
        tables = _rows(page_table)
        for b in range(y.shape[0]):  # each row at its own position, into its own sequence's pages
            self._rope_kv(y[b:b + 1], np.array([int(pos_dev[b])]), tables[b], k_cache, v_cache, layer,
                          _rows(q_out)[b:b + 1], c)

    def _rope_kv(self, qkv, pos, page_table, k_cache, v_cache, layer, q_out, c):
        T, Q, KV = qkv.shape[0], c.q_dim, c.kv_dim
        q = self._rope(qkv[:, :Q].reshape(T, c.n_heads, c.head_dim), pos)
        k = self._rope(qkv[:, Q:Q + KV].reshape(T, c.n_kv_heads, c.head_dim), pos)
        v = qkv[:, Q + KV:].reshape(T, c.n_kv_heads, c.head_dim)
        q_out[...] = q.reshape(T, Q).astype(q_out.dtype)
        self._write_kv(k.astype(np.float16), v.astype(np.float16), pos, page_table, k_cache, v_cache, layer)

    @_launcher
    def gate_up_silu(self, qweight, scales, x, norm_w, eps, out, a8_image=False):
        h = self._gemv_x(_rms(_rows(x), norm_w, eps))
        gu = _mm(h, self._w(qweight, scales))
        n = out.shape[-1]
        act = _silu_mul(gu[:, :n], gu[:, n:]).astype(out.dtype)
        if a8_image:  # the result as down_proj's a8 image, in out's storage
            from nanoqwen_kernels.a8 import a8_image

            img = a8_image(act[0])
            np.asarray(out).reshape(-1).view(np.uint8)[: img.shape[0]] = img
        else:
            _rows(out)[...] = act

    def qkv_rope_kv_short(self, *a, **k):
        """The short-context build's q/k/v (on the GPU its prologue may be shared by a cluster; the same
        numbers): here the same launcher."""
        return self.qkv_rope_kv(*a, **k)

    def gate_up_silu_short(self, *a, **k):
        """The short-context build's gate/up: here the same launcher."""
        return self.gate_up_silu(*a, **k)

    @_launcher
    def attention_decode(self, q, k_cache, v_cache, page_table, seq_len_dev, layer, out, workspace):
        self._attention_decode(q, k_cache, v_cache, page_table, seq_len_dev, layer, out)

    @_launcher
    def attention_decode_long(self, q, k_cache, v_cache, page_table, seq_len_dev, layer, out, workspace):
        """The long-context build: on the GPU another grid over the same pages; here the same numbers,
        counted (long_calls) so the tests see which build a step ran."""
        self.long_calls += 1
        self._attention_decode(q, k_cache, v_cache, page_table, seq_len_dev, layer, out)

    @_launcher
    def attention_decode_short(self, q, k_cache, v_cache, page_table, seq_len_dev, layer, out, workspace):
        """The short-context launch: on the GPU one cluster per sequence from a build pairing its pages (the same
        attention up to rounding); here the same numbers, counted (short_calls)."""
        self.short_calls += 1
        self._attention_decode(q, k_cache, v_cache, page_table, seq_len_dev, layer, out)

    def _attention_decode(self, q, k_cache, v_cache, page_table, seq_len_dev, layer, out):
        qr, o, tables = _rows(q), _rows(out), _rows(page_table)
        for b in range(qr.shape[0]):
            n = int(seq_len_dev[b])
            if n == 0:  # an idle row reads nothing and gives 0, as the kernel does
                o[b] = 0
                continue
            qh = qr[b].astype(np.float32).reshape(1, self.cfg.n_heads, self.cfg.head_dim)
            o[b] = self._attend(qh, k_cache, v_cache, tables[b], layer, np.array([n - 1]), n)[0].astype(out.dtype)

    def attention_workspace(self, max_batch: int = 64):
        return np.zeros(1, dtype=np.float32)  # the numpy attention needs none; a buffer of the right kind

    @_launcher
    def gemv_fp16(self, w, x, out):
        key = (w.ctypes.data, w.shape[0], -1)
        wf = self._deq.get(key)
        if wf is None:
            wf = self._deq[key] = w.astype(np.float32)
        _rows(out)[...] = _mm(_rows(x).astype(np.float32), wf)

    # ---- the int8 lm_head (kernels' head_i8.py: these are its numpy twins) ----
    @_launcher
    def quantize_head_i8(self, w, q_out, s_out):
        q_out[...], s_out[...] = h8.quantize_head_i8(w)

    @_launcher
    def dequantize_head_i8(self, q, s, out):
        out[...] = h8.dequantize_head_i8(q, s, np.float16)

    @_launcher
    def gemv_head_i8(self, q, s, x, out):
        # head_i8_logits's float32 s * q with fp32 sums; the dequantized matrix is cached per buffer (the
        # head never changes after load) rather than rebuilt on every step
        xr = _rows(x)
        if xr.shape[0] != 1:
            raise KernelError(f"gemv_head_i8 takes one row (batch 1), got x of {xr.shape[0]} rows")
        key = (q.ctypes.data, q.shape[0], "i8")
        wf = self._deq.get(key)
        if wf is None:
            wf = self._deq[key] = h8.dequantize_head_i8(q, s)
        _rows(out)[...] = _mm(xr.astype(np.float32), wf)

    @_launcher
    def argmax(self, logits, token_out):
        token_out[...] = np.argmax(_rows(logits), axis=1)

    def make_sampler_state(self, rows: int = 1):
        # params f32 [rows, 5]: temperature, top_k, top_p, min_p, repetition penalty; rng u64 [rows, 2]
        return np.zeros((rows, 5), dtype=np.float32), np.zeros((rows, 2), dtype=np.uint64)

    @_launcher
    def sample(self, logits, params, rng_state, history, token_out):
        from ..params import SamplingParams
        from ..sampler import _softmax, processed_logits

        lr = _rows(logits)
        for b in range(lr.shape[0]):
            t, k, p, mp, rp = (float(v) for v in params[b])
            sp = SamplingParams(temperature=t, top_k=int(k), top_p=p, min_p=mp, repetition_penalty=rp)
            x = processed_logits(np.asarray(lr[b], np.float32), sp, history[b].astype(bool))
            if t == 0:
                tok = int(np.argmax(x))
            else:  # a counter-based draw: (seed, step) alone decide it, as on the device
                gen = np.random.default_rng([int(rng_state[b, 0]), int(rng_state[b, 1])])
                probs = _softmax(x)
                tok = int(gen.choice(len(probs), p=probs / probs.sum()))
            rng_state[b, 1] += 1
            history[b, tok] = 1
            token_out[b] = tok

    @_launcher
    def advance(self, pos_dev, seq_len_dev):
        act = seq_len_dev > 0  # idle rows stay idle
        pos_dev[act] += 1
        seq_len_dev[act] += 1

    # --- prefill launchers ---
    @_launcher
    def dequantize_int4(self, qweight, scales, out):
        out[...] = self._w(qweight, scales).astype(np.float16)

    @_launcher
    def gemm_int4(self, qweight, scales, X, out, workspace=None, accumulate=False):
        # the kernel dequantizes W to fp16 (one rounding of s * q), then multiplies: so does this
        self._gemm(X, self._w(qweight, scales).astype(np.float16), out, accumulate)

    @_launcher
    def gemm_int4_wg(self, qweight, scales, X, out, accumulate=False, tile=None, splits=None, workspace=None):
        # the fused kernel dequantizes each weight to fp16 (one rounding of s * q) in registers, fp32 sums
        self._gemm(X, self._w(qweight, scales).astype(np.float16), out, accumulate)

    @_launcher
    def gemm_int4_wg_silu(self, qweight, scales, X, out, tile=None):
        # the gate|up sums in fp32, silu(gate) * up from them, one rounding (no fp16 gate/up in between)
        gu = X.astype(np.float32) @ self._w(qweight, scales).astype(np.float16).astype(np.float32).T
        i = gu.shape[1] // 2
        out[...] = _silu_mul(gu[:, :i], gu[:, i:]).astype(out.dtype)

    # ---- the opt-in FP8 prefill (kernels' prefill_fp8.py: these are its numpy twins) ----
    def int4_to_e4m3(self, qweight, scales, rowmap=None):
        from nanoqwen_format import unpack_valueshuffle

        n, k = qweight.shape[0], qweight.shape[1] * 8
        rows = np.arange(n) if rowmap is None else np.asarray(rowmap)
        w8 = f8.E4M3_OF_U[unpack_valueshuffle(qweight)[rows]]
        sw = np.zeros((k // 128, f8.n_pad(n)), dtype=np.float32)
        sw[:, :n] = scales[rows].astype(np.float32).T
        return w8, sw

    @_launcher
    def quantize_e4m3(self, X, xq, sx):
        q, s = f8.quantize_rows_np(X)
        xq[...] = q
        sx[: s.shape[0]] = s

    @_launcher
    def rmsnorm_e4m3(self, x, w, xq, sx, eps):
        q, s = f8.quantize_rows_np(_rms(x, w, eps).astype(np.float16))
        xq[...] = q
        sx[: s.shape[0]] = s

    @_launcher
    def gemm_fp8(self, w8, sw, xq, sx, out, accumulate=False, tile=None, splits=None, workspace=None):
        acc = f8.gemm_fp8_np(w8, sw, xq, sx)
        if accumulate:
            acc += out.astype(np.float64)
        out[...] = acc.astype(out.dtype)

    @_launcher
    def gemm_fp8_silu(self, w8, sw, xq, sx, out, tile=None):
        # the copy's rows are interleaved (prefill_fp8.silu_rowmap): put gate | up back in order first
        n = w8.shape[0]
        inv = np.argsort(f8.silu_rowmap(n))
        gu = f8.gemm_fp8_np(w8[inv], sw[:, inv], xq, sx)
        i = n // 2
        out[...] = _silu_mul(gu[:, :i], gu[:, i:]).astype(out.dtype)

    @_launcher
    def gemm_f16(self, w, X, out, accumulate=False):
        self._gemm(X, w, out, accumulate)

    @staticmethod
    def _gemm(X, w16, out, accumulate) -> None:
        acc = X.astype(np.float32) @ w16.astype(np.float32).T
        if accumulate:  # the GEMM's beta = 1: the sum in fp32, one rounding
            acc += out.astype(np.float32)
        out[...] = acc.astype(out.dtype)

    @_launcher
    def rope_kv_prefill(self, qkv, start_pos, page_table, k_cache, v_cache, layer, q_out, bias=None, ctl=None):
        T = qkv.shape[0]
        if ctl is not None:  # a captured graph's bucket: (start_pos, real rows) read at run time
            start_pos, T = int(ctl[0]), int(ctl[1])
        x = qkv[:T].astype(np.float32)
        if bias is not None:  # in fp32, as the kernel adds it
            x += bias.astype(np.float32)
        self._rope_kv(x, np.arange(start_pos, start_pos + T), page_table, k_cache,
                      v_cache, layer, q_out[:T], self.cfg)

    @_launcher
    def attention_prefill(self, q, k_cache, v_cache, page_table, start_pos, T, layer, out, ctl=None):
        c = self.cfg
        if ctl is not None:  # the padding rows past ctl[1] are neither read nor written
            start_pos, T = int(ctl[0]), int(ctl[1])
        qh = q[:T].astype(np.float32).reshape(T, c.n_heads, c.head_dim)
        qpos = np.arange(start_pos, start_pos + T)
        out[:T] = self._attend(qh, k_cache, v_cache, page_table, layer, qpos, start_pos + T).astype(out.dtype)

    @_launcher
    def silu_mul(self, gu, out):
        i = out.shape[1]
        out[...] = _silu_mul(gu[:, :i].astype(np.float32), gu[:, i:].astype(np.float32)).astype(out.dtype)
