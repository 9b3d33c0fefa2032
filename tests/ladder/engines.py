"""Engines for the ladder: the GPU engine under test and the CPU reference, on the same file.

Built here rather than with Engine.load so the tests choose the decode mode and the reference's
weight budget (a 7B reference dequantizes every layer once when the budget holds them all, instead of
once per forward); Engine.load's own GPU path is tested separately (test_ladder_graph.py).
"""

from __future__ import annotations

import os
import time

import numpy as np
from nanoqwen_engine import Engine
from nanoqwen_engine.config import ModelConfig
from nanoqwen_engine.reference import ReferenceBackend
from nanoqwen_engine.reference.backend import apply_rope, rmsnorm, rope_tables
from nanoqwen_engine.tokenizer import Tokenizer
from nanoqwen_format import open_model


def _open(path):
    nq = open_model(path)
    return nq, ModelConfig.from_hf(nq.config, nq.generation_config), Tokenizer(nq.tokenizer_json,
                                                                                 nq.tokenizer_config)


def gpu_engine(path, max_context: int, decode_mode: str = "graph", decode_activations: str | None = None) -> Engine:
    """The engine under test. NANOQWEN_LADDER_HOST=1 swaps the GPU for the numpy stand-ins of
    nanoqwen_engine.cuda (device.HostDevice, host_kernels.HostKernels): a dry run of the ladder's own
    code on a machine without a GPU (the tests still need the gpu fixture; call them directly)."""
    from nanoqwen_engine.cuda import CudaBackend

    t0 = time.perf_counter()
    nq, cfg, tok = _open(path)
    kw = {}
    if os.environ.get("NANOQWEN_LADDER_HOST") == "1":
        from nanoqwen_engine.cuda.device import HostDevice
        from nanoqwen_engine.cuda.host_kernels import HostKernels
        from nanoqwen_engine.cuda.load import decode_activations_plan

        dev = HostDevice()  # the stand-in of the kernel variant the GPU would build
        kw = dict(device=dev, kernels=HostKernels(cfg, dev, decode_activations_plan(decode_activations, None)[1]))
    if decode_activations is not None:
        kw["decode_activations"] = decode_activations
    be = CudaBackend.create(nq, cfg, max_context=max_context, progress=False, decode_mode=decode_mode, **kw)
    return Engine(be, tok, nq, path, time.perf_counter() - t0)


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 << 30


def cpu_engine(path, max_context: int, budget: int | None = None) -> Engine:
    """The reference. budget: bytes of float32 weights it keeps; default a third of RAM, which holds a
    whole 7B (26 GiB of layers) on the GPU machine. A small budget (4 GiB) dequantizes layers lazily:
    right for a test that needs one layer.

    When the budget holds every layer they are dequantized up front by a thread pool (numpy releases the
    GIL in its vectorised unpack): ~3 s per 7B layer on one core, so 28 layers take ~1.5 min serially.
    That reaches into ReferenceWeights' private cache (_load, _layers); a test helper only.
    """
    from concurrent.futures import ThreadPoolExecutor

    from nanoqwen_engine.reference.weights import projection_bytes

    t0 = time.perf_counter()
    nq, cfg, tok = _open(path)
    budget = budget if budget is not None else max(4 << 30, _ram_bytes() // 3)
    whole = projection_bytes(cfg) <= budget
    # created lazy (nothing dequantized yet), then filled in parallel when the budget holds it all
    be = ReferenceBackend.create(nq, cfg, max_context=max_context, weight_budget=budget if not whole else 1 << 20)
    w = be.weights
    if whole:
        w.budget = budget
        with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as ex:
            for i, layer in enumerate(ex.map(w._load, range(cfg.n_layers))):
                w._layers[i] = layer
        w.lazy = False
        w.fit_head_f32()  # the head's float32 values (the int8 head's s * q by default) under the new budget
    return Engine(be, tok, nq, path, time.perf_counter() - t0)


def reference_block(ref: ReferenceBackend, layer: int, x: np.ndarray) -> np.ndarray:
    """Decoder layer `layer` of the reference's float32 weights over rows x [T,H] at positions 0..T-1,
    causal, with the reference backend's own rmsnorm/RoPE helpers (no cache: plain arrays)."""
    cfg = ref.config
    w = ref.weights.layer(layer)
    T = x.shape[0]
    cos, sin = rope_tables(np.arange(T), cfg.head_dim, cfg.rope_theta)
    h = rmsnorm(x, w.in_norm, cfg.rms_eps)
    q = apply_rope((h @ w.q.T + w.q_bias).reshape(T, cfg.n_heads, cfg.head_dim), cos, sin)
    k = apply_rope((h @ w.k.T + w.k_bias).reshape(T, cfg.n_kv_heads, cfg.head_dim), cos, sin)
    v = (h @ w.v.T + w.v_bias).reshape(T, cfg.n_kv_heads, cfg.head_dim)
    g = cfg.n_heads // cfg.n_kv_heads
    qg = q.reshape(T, cfg.n_kv_heads, g, cfg.head_dim)
    s = np.einsum("tkgd,skd->kgts", qg, k) / np.float32(np.sqrt(cfg.head_dim))
    s = np.where(np.tril(np.ones((T, T), dtype=bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    attn = np.einsum("kgts,skd->tkgd", p, v).reshape(T, cfg.q_dim)
    x = x + attn @ w.o.T
    h = rmsnorm(x, w.post_norm, cfg.rms_eps)
    gate = h @ w.gate.T
    with np.errstate(over="ignore"):
        act = gate / (1.0 + np.exp(-gate))
    return x + (act * (h @ w.up.T)) @ w.down.T


def reference_head(ref: ReferenceBackend, h: np.ndarray) -> np.ndarray:
    """float32 [V] logits of one hidden row: final norm + lm_head, as the reference computes them."""
    cfg = ref.config
    return ref.weights.logits(rmsnorm(h[None, :].astype(np.float32), ref.weights.final_norm, cfg.rms_eps))[0]
