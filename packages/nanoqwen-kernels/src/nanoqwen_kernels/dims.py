"""ModelDims: the model shape a kernel build is specialised for (docs/INTERFACES.md section 4). The engine
builds one from its ModelConfig; this package never parses a model config itself.

Every dim becomes a compile-time constant (`-DNQ_*`) so the compiler unrolls the K loops and folds the
row/head arithmetic; each Qwen2.5 size gets its own cubin from the same sources. The whitelist below is
what the kernels actually assume; anything else is refused here, before NVRTC sees it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import KernelError
from .loader import Define

GROUP = 128  # INT4 quantization group along K (docs/FORMAT.md); the GEMV tiles K by whole groups
HEAD_DIM = 128  # RoPE pairs d and d+64 and the attention tiles assume 128-wide heads
PAGE_TOKENS = 16  # tokens per KV page (docs/INTERFACES.md section 3)


class HeadWidths:
    """The attention widths that follow from n_heads, n_kv_heads and head_dim: written once here for
    ModelDims and for the engine's ModelConfig (which derives from this too; importing it needs no CuPy)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def qkv_rows(self) -> int:
        """Rows of the fused q/k/v projection: q, then k, then v."""
        return self.q_dim + 2 * self.kv_dim


@dataclass(frozen=True)
class ModelDims(HeadWidths):
    hidden: int  # H: residual stream width
    intermediate: int  # I: MLP width (gate/up rows, down K)
    n_heads: int  # query heads
    n_kv_heads: int  # KV heads (GQA group = n_heads / n_kv_heads)
    head_dim: int  # must be 128
    vocab: int  # V: embedding / lm_head rows
    n_layers: int
    rope_theta: float  # RoPE base (Qwen2.5: 1e6), from the model's config: no default here

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "n_heads", "n_kv_heads", "head_dim", "vocab", "n_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise KernelError(f"ModelDims.{name} must be a positive int, got {v!r}")
        if not (self.rope_theta > 0):
            raise KernelError(f"ModelDims.rope_theta must be > 0, got {self.rope_theta!r}")
        if self.head_dim != HEAD_DIM:
            raise KernelError(f"unsupported head_dim {self.head_dim}: the kernels are built for {HEAD_DIM}")
        if self.hidden % GROUP:
            raise KernelError(f"unsupported hidden {self.hidden}: must be a multiple of {GROUP} (INT4 group)")
        if self.intermediate % GROUP:
            raise KernelError(
                f"unsupported intermediate {self.intermediate}: must be a multiple of {GROUP} (INT4 group)"
            )
        if self.n_heads % self.n_kv_heads:
            raise KernelError(
                f"unsupported heads: n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}"
            )

    def rope_inv_freq(self) -> tuple[float, ...]:
        """RoPE's inverse frequencies 1 / theta^(2d / head_dim), d < head_dim / 2: computed in fp64 and
        rounded once to fp32, as the reference backend computes them (so the correctly rounded values)."""
        hd = self.head_dim
        return tuple(float(np.float32(1.0 / self.rope_theta ** ((2.0 * d) / hd))) for d in range(hd // 2))

    def defines(self) -> dict[str, Define]:
        """The -D constants every kernel source sees (names mirrored in cuda/common.cuh). The RoPE table is
        one of them: computing 1 / theta^(2d/128) in fp64 where it is used cost the fused q/k/v epilogue
        ~550 fp64 instructions (SASS of the 7B tile64 entry) and its last block ~10 us at B = 64."""
        return {
            "NQ_HIDDEN": self.hidden,
            "NQ_INTER": self.intermediate,
            "NQ_NHEADS": self.n_heads,
            "NQ_NKV": self.n_kv_heads,
            "NQ_HEAD_DIM": self.head_dim,
            "NQ_VOCAB": self.vocab,
            "NQ_NLAYERS": self.n_layers,
            "NQ_ROPE_THETA": float(self.rope_theta),
            "NQ_ROPE_INV_FREQ": self.rope_inv_freq(),
        }


# Named shapes, written out once for the tests and benchmarks (the engine builds its ModelDims from its
# own ModelConfig, the one parser of a model's config). TINY is the shape every CPU test compiles.
QWEN25_7B = ModelDims(
    hidden=3584, intermediate=18944, n_heads=28, n_kv_heads=4, head_dim=128, vocab=152064, n_layers=28,
    rope_theta=1e6,
)
QWEN25_1_5B = ModelDims(
    hidden=1536, intermediate=8960, n_heads=12, n_kv_heads=2, head_dim=128, vocab=151936, n_layers=28,
    rope_theta=1e6,
)
TINY = ModelDims(
    hidden=256, intermediate=512, n_heads=2, n_kv_heads=1, head_dim=128, vocab=1000, n_layers=2, rope_theta=1e6
)
PRESETS = {"7b": QWEN25_7B, "1.5b": QWEN25_1_5B, "tiny": TINY}
