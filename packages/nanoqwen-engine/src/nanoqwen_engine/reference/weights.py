"""Float32 weights for the reference backend, dequantized from the file's INT4 projections.

A small model is dequantized once at load. A model whose float32 projections exceed the budget (a 7B file
is ~26 GiB of float32 projections, more than a 24 GiB machine holds) is dequantized one layer at a time
when used: the first layers that fit in `budget` bytes stay, the others are dequantized again on every
forward pass, so it stays loadable and scoreable, at minutes per forward pass (docs/ARCHITECTURE.md).

The lm_head multiplies the values lm_head_dtype names (nanoqwen_engine.lm_head): the file's fp16 values,
or ("int8", the default) s * q in float32 of the head quantized once at load (nanoqwen_kernels.head_i8),
the values the GPU backend multiplies too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from nanoqwen_kernels.head_i8 import dequantize_head_i8, quantize_head_i8

from ..config import ModelConfig

PROJS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def default_budget() -> int:
    """Bytes of float32 projection weights kept in memory: half of the machine's physical memory, at least
    4 GiB. On a 24 GiB machine that keeps all of the real 1.5B (5.2 GB of float32 projections; with the
    old fixed 4 GiB, 7 of its 28 layers were dequantized again on every token, ~7 s of CPU per token)
    and leaves a 7B (26 GiB) lazy."""
    import os

    try:
        phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        phys = 0
    return max(4 << 30, phys // 2)


DEFAULT_BUDGET = default_budget()


@dataclass
class LayerWeights:
    # float32, HF [out, in] orientation (y = x @ w.T)
    q: np.ndarray  # [n_heads*hd, H]
    k: np.ndarray  # [n_kv*hd, H]
    v: np.ndarray  # [n_kv*hd, H]
    o: np.ndarray  # [H, n_heads*hd]
    gate: np.ndarray  # [I, H]
    up: np.ndarray  # [I, H]
    down: np.ndarray  # [H, I]
    q_bias: np.ndarray  # [n_heads*hd]
    k_bias: np.ndarray  # [n_kv*hd]
    v_bias: np.ndarray  # [n_kv*hd]
    in_norm: np.ndarray  # [H]
    post_norm: np.ndarray  # [H]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.__dict__.values())


def projection_bytes(cfg: ModelConfig) -> int:
    """float32 bytes of all layers' projections."""
    per = cfg.hidden * cfg.qkv_rows + cfg.q_dim * cfg.hidden + 3 * cfg.hidden * cfg.intermediate
    return 4 * per * cfg.n_layers


class ReferenceWeights:
    def __init__(self, nqfile, cfg: ModelConfig, budget: int = DEFAULT_BUDGET, lm_head_dtype: str = "int8"):
        """lm_head_dtype: "int8" or "fp16" (nanoqwen_engine.lm_head; the caller has checked it)."""
        self._f = nqfile
        self.cfg = cfg
        self.budget = budget
        self._layers: dict[int, LayerWeights] = {}
        # Embedding and lm_head stay float16 views of the file (2 x 1 GiB for 7B); rows or chunks are
        # converted to float32 where used.
        self.embed = nqfile.tensor("model.embed_tokens.weight")  # f16 [V, H]
        self.lm_head = self.embed if cfg.tie_word_embeddings else nqfile.tensor("lm_head.weight")  # f16 [V, H]
        # int8: (q uint8 [V, H], s f16 [V, H/128]), quantized once here (7B: 0.55 GB, half the fp16 head)
        self.head_i8 = quantize_head_i8(np.asarray(self.lm_head)) if lm_head_dtype == "int8" else None
        self.final_norm = self._f32("model.norm.weight")  # f32 [H]
        self._head_f32: np.ndarray | None = None
        self.fit_head_f32()
        self.lazy = projection_bytes(cfg) > budget
        if not self.lazy:
            for i in range(cfg.n_layers):
                self._layers[i] = self._load(i)

    def _f32(self, name: str) -> np.ndarray:
        return np.asarray(self._f.tensor(name), dtype=np.float32)

    def _load(self, i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        dq = {s: np.ascontiguousarray(self._f.dequantize(p + s + ".weight"), dtype=np.float32) for s in PROJS}
        return LayerWeights(
            q=dq[PROJS[0]], k=dq[PROJS[1]], v=dq[PROJS[2]], o=dq[PROJS[3]],
            gate=dq[PROJS[4]], up=dq[PROJS[5]], down=dq[PROJS[6]],
            q_bias=self._f32(p + "self_attn.q_proj.bias"),
            k_bias=self._f32(p + "self_attn.k_proj.bias"),
            v_bias=self._f32(p + "self_attn.v_proj.bias"),
            in_norm=self._f32(p + "input_layernorm.weight"),
            post_norm=self._f32(p + "post_attention_layernorm.weight"),
        )

    def layer(self, i: int) -> LayerWeights:
        w = self._layers.get(i)
        if w is not None:
            return w
        w = self._load(i)
        # Layers are used in a cycle 0..L-1, where least-recently-used eviction misses every time; keeping
        # the first layers that fit and dequantizing the rest on each use saves budget/layer_bytes loads
        # per forward pass.
        if sum(x.nbytes for x in self._layers.values()) + w.nbytes <= self.budget:
            self._layers[i] = w
        return w

    def embed_rows(self, ids: np.ndarray) -> np.ndarray:
        """ids int [T] -> float32 [T, H]."""
        return self.embed[ids].astype(np.float32)

    def head_rows_f32(self, a: int, b: int) -> np.ndarray:
        """float32 [b - a, H]: rows a..b-1 of the matrix the logits multiply (the file's fp16 values, or s * q
        of the int8 head)."""
        if self.head_i8 is None:
            return self.lm_head[a:b].astype(np.float32)
        q, s = self.head_i8
        return dequantize_head_i8(q[a:b], s[a:b])

    def fit_head_f32(self) -> None:
        """Keep the head's float32 values resident when they take at most a quarter of `budget`, else none:
        a [V, H] float32 copy of a 7B head is 2 GiB, so logits() then converts it chunk by chunk. Called at
        load, and again by whoever changes `budget` afterwards."""
        v = self.lm_head.shape[0]
        self._head_f32 = self.head_rows_f32(0, v) if self.lm_head.nbytes * 2 <= self.budget // 4 else None

    def logits(self, h: np.ndarray) -> np.ndarray:
        """h float32 [T, H] (final-normed) -> float32 [T, V]."""
        if self._head_f32 is not None:
            return h @ self._head_f32.T if h.shape[0] > 1 else (self._head_f32 @ h[0])[None, :]
        out = np.empty((h.shape[0], self.lm_head.shape[0]), dtype=np.float32)
        step = 16384
        for a in range(0, self.lm_head.shape[0], step):
            out[:, a : a + step] = h @ self.head_rows_f32(a, a + step).T
        return out

    @property
    def head_i8_bytes(self) -> int:
        """Bytes of the int8 head's q and s (0 for "fp16")."""
        return 0 if self.head_i8 is None else sum(int(x.nbytes) for x in self.head_i8)

    @property
    def resident_bytes(self) -> int:
        b = sum(x.nbytes for x in self._layers.values()) + self.final_norm.nbytes + self.head_i8_bytes
        return b + (self._head_f32.nbytes if self._head_f32 is not None else 0)
