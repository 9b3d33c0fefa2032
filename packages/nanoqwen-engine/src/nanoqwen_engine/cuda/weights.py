"""The GPU weights as typed records, named like the reference backend's (reference/weights.py).

The upload (plan.py, device.py) fills one device buffer per plan key; `gpu_weights` groups them into
records, so the decode and prefill code names `layer.qkv.qweight` instead of `w[f"{i}.qkv.w"]`. The fused
matrices are the reference's projections stacked by rows (plan.py): `qkv` = q|k|v, `gate_up` = gate|up.

    GpuWeights: embed [V, H] f16, lm_head [V, H] f16 (the embed buffer itself when tied), final_norm [H]
                f16, layers: list[GpuLayer], lm_head_i8: Int8Head | None (lm_head_dtype "int8"; `lm_head`
                then holds its dequantized values: with_int8_head)
    Int8Head:   q uint8 [V, H] (offset binary, q + 128), s f16 [V, H/128] (nanoqwen_kernels.head_i8)
    GpuLayer:   in_norm, post_norm [H] f16; qkv, o, gate_up, down: Int4Weight; qkv_bias [Nq + 2 Nkv] f16
    Int4Weight: qweight uint32 [N, K/8] (ValueShuffle words), scales f16 [N, K/128]
    DenseLayer: the same layer's four matrices dequantized to f16 [N, K] (prefill's resident copy,
                plan.choose_prefill_weights), built on the device by dense_layers
    Fp8Layer:   the same four as Fp8Weight (w8 uint8 [N, K]: the INT4 integers in e4m3, exact; sw f32
                [G, n_pad]: their group scales), the opt-in FP8 prefill's resident copy (fp8_layers); gate_up's
                rows interleaved for the SiLU build (prefill_fp8.silu_rowmap)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from nanoqwen_kernels.head_i8 import GROUP


@dataclass(frozen=True)
class Int4Weight:
    qweight: Any  # uint32 [N, K/8]
    scales: Any  # f16 [N, K/128]

    @property
    def nbytes(self) -> int:
        return int(self.qweight.nbytes) + int(self.scales.nbytes)


@dataclass(frozen=True)
class GpuLayer:
    in_norm: Any  # f16 [H] (input_layernorm)
    qkv: Int4Weight  # rows q | k | v
    qkv_bias: Any  # f16 [Nq + 2 Nkv]
    o: Int4Weight
    post_norm: Any  # f16 [H] (post_attention_layernorm)
    gate_up: Int4Weight  # rows gate | up
    down: Int4Weight


@dataclass(frozen=True)
class Int8Head:
    """The lm_head in int8 with one fp16 scale per 128 values along H: what the batch-1 GEMV gemv_head_i8
    reads (half the bytes of the fp16 matrix)."""

    q: Any  # uint8 [V, H], offset binary (q + 128)
    s: Any  # f16 [V, H/128]


@dataclass(frozen=True)
class GpuWeights:
    embed: Any  # f16 [V, H]: token lookups (always the file's values)
    lm_head: Any  # f16 [V, H]: what batches of 2 or more rows and score() multiply
    final_norm: Any  # f16 [H]
    layers: list[GpuLayer]
    lm_head_i8: Int8Head | None = None  # lm_head_dtype "int8": what a batch of one row multiplies


def gpu_weights(bufs: dict[str, Any], n_layers: int) -> GpuWeights:
    """Records over the uploaded buffers (keys of plan.build_upload_plan)."""

    def int4(i: int, key: str) -> Int4Weight:
        return Int4Weight(bufs[f"{i}.{key}.w"], bufs[f"{i}.{key}.s"])

    layers = [
        GpuLayer(in_norm=bufs[f"{i}.ln1"], qkv=int4(i, "qkv"), qkv_bias=bufs[f"{i}.qkv.b"], o=int4(i, "o"),
                 post_norm=bufs[f"{i}.ln2"], gate_up=int4(i, "gu"), down=int4(i, "down"))
        for i in range(n_layers)
    ]
    return GpuWeights(embed=bufs["embed"], lm_head=bufs["lm_head"], final_norm=bufs["norm"], layers=layers)


def int8_head_bytes(vocab: int, hidden: int, tied: bool) -> int:
    """Device bytes with_int8_head adds to the upload: q [V, H] u8 and s [V, H/128] f16, plus, for a head
    tied to the embedding, the fp16 [V, H] buffer of its dequantized values (7B, untied: 0.55 GB)."""
    return vocab * hidden + 2 * vocab * (hidden // GROUP) + (2 * vocab * hidden if tied else 0)


def with_int8_head(xp, ks, weights: GpuWeights) -> GpuWeights:
    """`weights` with the lm_head in int8: q and s quantized from the fp16 lm_head (ks.quantize_head_i8),
    and `lm_head` replaced by their values rounded to fp16 (ks.dequantize_head_i8: fp16(s * q)), so that the
    paths that multiply an fp16 matrix (batches of 2 or more, score()) multiply the int8 values too.

    An untied head is dequantized in place, over the file's values (nothing reads them after q and s
    exist); a tied one is the embed buffer, whose file values the token lookups need, so its dequantized
    copy gets a buffer of its own."""
    w = weights.lm_head
    v, h = (int(n) for n in w.shape)
    head = Int8Head(q=xp.empty((v, h), dtype=np.uint8), s=xp.empty((v, h // GROUP), dtype=np.float16))
    ks.quantize_head_i8(w, head.q, head.s)
    dense = xp.empty((v, h), dtype=np.float16) if w is weights.embed else w
    ks.dequantize_head_i8(head.q, head.s, dense)
    return replace(weights, lm_head=dense, lm_head_i8=head)


@dataclass(frozen=True)
class DenseLayer:
    qkv: Any  # f16 [Nq + 2 Nkv, H]
    o: Any  # f16 [H, Nq]
    gate_up: Any  # f16 [2 I, H]
    down: Any  # f16 [H, I]


def dense_bytes(weights: GpuWeights) -> int:
    """Bytes of every layer's four matrices as f16 (4x their INT4 words)."""
    return sum(4 * int(w.qweight.nbytes) for lw in weights.layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down))


def dense_layers(xp, ks, weights: GpuWeights) -> list[DenseLayer]:
    """Each layer's matrices dequantized once into resident f16 buffers (ks.dequantize_int4, the kernel
    gemm_int4 runs before every GEMM: the same bits)."""

    def dense(w: Int4Weight):
        n, k8 = (int(v) for v in w.qweight.shape)
        out = xp.empty((n, 8 * k8), dtype=np.float16)
        ks.dequantize_int4(w.qweight, w.scales, out)
        return out

    return [DenseLayer(qkv=dense(lw.qkv), o=dense(lw.o), gate_up=dense(lw.gate_up), down=dense(lw.down))
            for lw in weights.layers]


@dataclass(frozen=True)
class Fp8Weight:
    w8: Any  # uint8 [N, K] e4m3
    sw: Any  # f32 [K/128, n_pad(N)]


@dataclass(frozen=True)
class Fp8Layer:
    qkv: Fp8Weight
    o: Fp8Weight
    gate_up: Fp8Weight  # rows in the SiLU build's order (prefill_fp8.silu_rowmap), for gemm_fp8_silu
    down: Fp8Weight


def fp8_bytes(weights: GpuWeights) -> int:
    """Bytes of every layer's four matrices as e4m3 (2x their INT4 words; the scales are ~1.6% more)."""
    return sum(2 * int(w.qweight.nbytes) + 2 * int(w.scales.nbytes)
               for lw in weights.layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down))


def fp8_layers(ks, weights: GpuWeights) -> list[Fp8Layer]:
    """Each layer's matrices converted once into resident e4m3 copies (ks.int4_to_e4m3)."""
    from nanoqwen_kernels.prefill_fp8 import silu_rowmap

    def fp8(w: Int4Weight, rowmap=None) -> Fp8Weight:
        return Fp8Weight(*ks.int4_to_e4m3(w.qweight, w.scales, rowmap))

    return [Fp8Layer(qkv=fp8(lw.qkv), o=fp8(lw.o), gate_up=fp8(lw.gate_up, silu_rowmap(int(lw.gate_up.qweight.shape[0]))),
                     down=fp8(lw.down))
            for lw in weights.layers]
