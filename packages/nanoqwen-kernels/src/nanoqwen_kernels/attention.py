"""Paged decode attention: launcher for cuda/attention_decode.cu (split kernel + combine).

`AttentionKernels(dims, load_module).attention_decode(q, k_cache, v_cache, page_table, seq_len_dev,
layer, out, workspace)` launches two kernels on the current CuPy stream and never synchronises; the
sequence length is read on the device, so a captured CUDA graph serves every token. Every bad argument
is one KernelError naming it (checks.py), before anything reaches the GPU.
"""

from __future__ import annotations

import numpy as np

from .checks import check_array, check_kv_cache, check_page_table, cupy_module, launch
from .dims import HEAD_DIM, PAGE_TOKENS, ModelDims
from .errors import KernelError

SM_COUNT = 132  # H100/H200 SXM; the split count is baked into the build to fill them
DECODE_SOURCES = ["attention_decode.cu"]
DECODE_STAGES = 8  # ring slots of 8 KiB (K+V page): 64 KiB in flight per SM (Little's law needs ~32 KB)
# Consumer variants: "fma" = fp32 dot products on CUDA cores, 4 consumer warps (8 spill registers);
# "mma" = mma.sync m16n8k16 on tensor cores (fp16 in, fp32 accumulate), 4 or 8 consumer warps.
# Default "fma": its SASS is the one GPU run 1 benchmarked (thousands of graph-replayed launches) and
# run 2 tested. "mma"/"mma8" pass every GPU test of run 2 and the sanitizers, but run 2's benchmark loop
# over the variants died with an illegal address that was not attributed to a variant (the loop now
# runs each variant in its own process); until a run clears them they stay opt-in.
VARIANTS = {"fma": (0, 4), "mma": (1, 4), "mma8": (1, 8)}
DEFAULT_VARIANT = "fma"


def decode_splits(dims: ModelDims, sm_count: int = SM_COUNT) -> int:
    """Splits over pages per KV head so that n_kv_heads x splits blocks fill the GPU (one block per SM)."""
    return max(1, sm_count // dims.n_kv_heads)


def _variant(variant: str) -> tuple[int, int]:
    if variant not in VARIANTS:
        raise KernelError(f"unknown attention_decode variant {variant!r}; one of {sorted(VARIANTS)}")
    return VARIANTS[variant]


def decode_defines(dims: ModelDims, variant: str = DEFAULT_VARIANT) -> dict[str, int | float]:
    mma, consumers = _variant(variant)
    return {
        **dims.defines(),
        "NQ_DECODE_SPLITS": decode_splits(dims),
        "NQ_DECODE_STAGES": DECODE_STAGES,
        "NQ_DECODE_MMA": mma,
        "NQ_DECODE_CONSUMERS": consumers,
    }


def decode_smem_bytes(dims: ModelDims, variant: str = DEFAULT_VARIANT) -> int:
    """Dynamic shared memory of attention_decode_split; mirrors kSmemBytes in attention_decode.cu."""
    consumers = _variant(variant)[1]
    g = dims.n_heads // dims.n_kv_heads
    ring = DECODE_STAGES * 2 * PAGE_TOKENS * HEAD_DIM * 2  # [stages][K|V][16][128] fp16
    merge = consumers * g * HEAD_DIM * 4 + 2 * consumers * 8 * 4  # acc + (m, l)
    pbuf = consumers * 16 * 8 * 4
    return ring + merge + pbuf + 2 * DECODE_STAGES * 8  # + full/empty mbarriers


def decode_workspace_floats(dims: ModelDims) -> int:
    """float32 elements the decode workspace needs: partial acc [splits, heads, 128] + (m, l) [splits, heads, 2]."""
    return decode_splits(dims) * dims.n_heads * (HEAD_DIM + 2)


class AttentionKernels:
    """The decode attention build for one ModelDims. `load_module(sources, defines)` is the loader's."""

    def __init__(self, dims: ModelDims, load_module, variant: str = DEFAULT_VARIANT):
        if dims.n_heads // dims.n_kv_heads > 8:
            raise KernelError(
                f"unsupported GQA group {dims.n_heads // dims.n_kv_heads}: attention_decode handles <= 8"
            )
        self.dims = dims
        self.variant = variant
        self.threads = 32 * (1 + _variant(variant)[1])  # 1 producer warp + the consumer warps
        self.splits = decode_splits(dims)
        self.smem_bytes = decode_smem_bytes(dims, variant)
        self.workspace_floats = decode_workspace_floats(dims)
        mod = load_module(DECODE_SOURCES, decode_defines(dims, variant))
        self._split = mod.get_function("attention_decode_split", max_dynamic_smem=self.smem_bytes)
        self._combine = mod.get_function("attention_decode_combine")

    def new_workspace(self):
        """A float32 workspace of the size attention_decode needs (allocate once, reuse every token)."""
        return cupy_module().empty(self.workspace_floats, dtype=np.float32)

    def attention_decode(self, q, k_cache, v_cache, page_table, seq_len_dev, layer, out, workspace) -> None:
        """out[h] = softmax(q[h] K^T / sqrt(128)) V over positions < seq_len_dev[0] of one layer's pages.

        q, out: fp16 [n_heads*128]; k/v_cache: fp16 [n_layers, n_pages, n_kv, 16, 128];
        page_table: int32 [max_pages]; seq_len_dev: int32 [>=1] (device); workspace: float32
        [>= workspace_floats] (see new_workspace). seq_len is clamped to max_pages*16 on the device.
        """
        d = self.dims
        check_array("q", q, np.float16, shape=(d.n_heads * HEAD_DIM,))
        check_array("out", out, np.float16, shape=(d.n_heads * HEAD_DIM,))
        layer, n_pages = check_kv_cache(d, k_cache, v_cache, layer)
        check_page_table(page_table)
        check_array("seq_len_dev", seq_len_dev, np.int32, min_size=1)
        check_array("workspace", workspace, np.float32, min_size=self.workspace_floats)
        ws_acc = workspace  # [splits, heads, 128] at the front, then (m, l) [splits, heads, 2]
        ws_ml = workspace[self.splits * d.n_heads * HEAD_DIM :]
        launch(
            self._split,
            (d.n_kv_heads, self.splits, 1),
            (self.threads, 1, 1),
            (
                q,
                k_cache,
                v_cache,
                page_table,
                seq_len_dev,
                np.int32(layer),
                np.int32(n_pages),
                np.int32(page_table.size),
                ws_acc,
                ws_ml,
            ),
            shared_mem=self.smem_bytes,
        )
        launch(self._combine, (d.n_heads, 1, 1), (HEAD_DIM, 1, 1), (ws_acc, ws_ml, out))
