"""KernelSet: every kernel of one model shape, compiled (or loaded from the disk cache) and exposed as
the typed launchers of docs/INTERFACES.md section 4.

    ks = KernelSet(ModelDims(hidden=..., ...))          # arch defaults to the current device's
    ks.qkv_rope_kv(...); ks.attention_decode(...); ks.gemv_int4(...); ks.argmax(...)

Each launcher lives beside its kernel (gemv.py, norm.py, embed.py, sampling.py, attention.py,
prefill.py, head_i8.py); KernelSet only builds them and forwards, so each contract is written once.
"""

from __future__ import annotations

import functools
import os

from . import checks as ck
from .attention import DEFAULT_VARIANT as DEFAULT_ATTENTION_VARIANT
from .attention import LONG_CLUSTER_MAX, SHORT_PAIR, AttentionKernels
from .attention import VARIANTS as ATTENTION_VARIANTS
from .dims import ModelDims
from .embed import EmbedKernels
from .errors import KernelError
from .gemv import (
    A8_VARIANTS,
    DEFAULT_GEMV_VARIANT,
    DEFAULT_LM_HEAD,
    GEMV_VARIANTS,
    LM_HEAD_BODIES,
    GemvKernels,
)
from .gemv_b1 import b1_short_defines
from .head_i8 import HeadI8Kernels
from .loader import device_arch, load_module
from .norm import NormKernels
from .prefill import PrefillKernels
from .sampling import SamplingKernels


class KernelSet:
    def __init__(self, dims: ModelDims, arch: str | None = None, gemv_variant: str | None = None,
                 lm_head: str | None = None, attention_variant: str | None = None):
        """gemv_variant: a key of gemv.GEMV_VARIANTS (default: $NANOQWEN_GEMV_VARIANT, else
        gemv.DEFAULT_GEMV_VARIANT); lm_head: one of gemv.LM_HEAD_BODIES, the lm_head's body at B > 1
        (default: $NANOQWEN_LM_HEAD, else gemv.DEFAULT_LM_HEAD); attention_variant: a key of
        attention.VARIANTS, decode attention's consumer body (default: $NANOQWEN_ATTENTION_VARIANT, else
        attention.DEFAULT_VARIANT)."""
        if not isinstance(dims, ModelDims):
            raise KernelError(f"KernelSet needs a ModelDims, got {type(dims).__name__}")
        variant = gemv_variant or os.environ.get("NANOQWEN_GEMV_VARIANT") or DEFAULT_GEMV_VARIANT
        if variant not in GEMV_VARIANTS:
            raise KernelError(
                f"unknown INT4 GEMV variant {variant!r} (NANOQWEN_GEMV_VARIANT); one of {', '.join(GEMV_VARIANTS)}"
            )
        head = lm_head or os.environ.get("NANOQWEN_LM_HEAD") or DEFAULT_LM_HEAD
        if head not in LM_HEAD_BODIES:
            raise KernelError(f"unknown lm_head body {head!r} (NANOQWEN_LM_HEAD); one of {', '.join(LM_HEAD_BODIES)}")
        attn = attention_variant or os.environ.get("NANOQWEN_ATTENTION_VARIANT") or DEFAULT_ATTENTION_VARIANT
        if attn not in ATTENTION_VARIANTS:
            raise KernelError(f"unknown decode attention variant {attn!r} (NANOQWEN_ATTENTION_VARIANT); "
                              f"one of {', '.join(ATTENTION_VARIANTS)}")
        self.dims = dims
        self.gemv_variant = variant
        self.attention_variant = attn
        self.lm_head = head
        self.arch = arch or device_arch()
        load = functools.partial(_load, arch=self.arch)
        g = GemvKernels(dims, load, variant, head)
        # the short-context build (gemv_b1.b1_short_defines; the decode step's graph for steps whose sequences are
        # all short), where it differs from the default build
        g_short = g
        if variant in A8_VARIANTS and b1_short_defines(dims, ck.sm_count()):
            g_short = GemvKernels(dims, load, variant, head, short_context=True)
        self.a8_image_pair = g.a8_image_pair  # gate/up -> down_proj at B = 1 through the a8 image (gemv.py)
        n = NormKernels(dims, load)
        e = EmbedKernels(dims, load)
        s = SamplingKernels(dims, load)
        a = AttentionKernels(dims, load, attn)
        # the long-context build (clusters of up to 16): the decode step launches it only for long contexts
        a_long = AttentionKernels(dims, load, attn, cluster_max=LONG_CLUSTER_MAX)
        # the short-context launch (one cluster per sequence and KV head, its consumers taking pages two at a
        # time: attention.SHORT_PAIR): the decode step launches it while every sequence of the step is short
        # (attention.SHORT_CONTEXT_TOKENS)
        a_short = AttentionKernels(dims, load, attn, max_clusters=1, pair=SHORT_PAIR)
        p = PrefillKernels(dims, load)
        h = HeadI8Kernels(dims, load)

        # the launchers, as bound methods (docs/INTERFACES.md section 4)
        self.gemv_int4 = g.gemv_int4
        self.qkv_rope_kv = g.qkv_rope_kv
        self.gate_up_silu = g.gate_up_silu
        self.qkv_rope_kv_short = g_short.qkv_rope_kv
        self.gate_up_silu_short = g_short.gate_up_silu
        self.gemv_fp16 = g.gemv_fp16
        self.gemv_head_i8 = h.gemv_head_i8
        self.quantize_head_i8 = h.quantize_head_i8
        self.dequantize_head_i8 = h.dequantize_head_i8
        self.rmsnorm = n.rmsnorm
        self.rmsnorm_rows = n.rmsnorm_rows
        self.embed = e.embed
        self.argmax = s.argmax
        self.sample = s.sample
        self.advance = s.advance
        self.make_sampler_state = s.make_sampler_state
        self.set_sampler_params = s.set_sampler_params
        self.attention_decode = a.attention_decode
        self.attention_decode_long = a_long.attention_decode
        self.attention_decode_short = a_short.attention_decode
        self.attention_workspace = a.new_workspace
        self.dequantize_int4 = p.dequantize_int4
        self.gemm_int4 = p.gemm_int4
        self.gemm_int4_wg = p.gemm_int4_wg
        self.gemm_int4_wg_silu = p.gemm_int4_wg_silu
        self.gemm_f16 = p.gemm_f16
        self.int4_to_e4m3 = p.int4_to_e4m3
        self.quantize_e4m3 = p.quantize_e4m3
        self.rmsnorm_e4m3 = p.rmsnorm_e4m3
        self.gemm_fp8 = p.gemm_fp8
        self.gemm_fp8_silu = p.gemm_fp8_silu
        self.silu_mul = p.silu_mul
        self.rope_kv_prefill = p.rope_kv_prefill
        self.attention_prefill = p.attention_prefill


def _load(sources, defines, arch):
    return load_module(list(sources), dict(defines), arch)
