"""Napkin math for decode: the bytes one token must read, from the file's own tensor table.

One decode step of batch 1 reads every INT4 projection (packed words + fp16 scales) once, the lm_head
(the tied embedding for small models) once, and the K/V of every token in the context; the rest (norms,
biases, one embedding row) is a few hundred KiB and is left out. The lm_head counts as the engine stores
it (its lm_head_dtype): the file's fp16 matrix, or its int8 copy (one byte a value plus an fp16 scale per
128). Achieved bandwidth is those bytes divided by the measured time per token; for the 7B that is
4.46 GB (fp16 head) or 3.92 GB (int8 head) + 56 KiB per token of context.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoqwen_kernels.head_i8 import GROUP as HEAD_I8_GROUP  # values per fp16 scale of the int8 lm_head

PROJECTION_SUFFIXES = (".qweight", ".scales")
FP16_BYTES = 2


@dataclass(frozen=True)
class DecodeBytes:
    projections: int  # INT4 words of every q/k/v/o/gate/up/down projection
    scales: int  # their fp16 group scales
    lm_head: int  # lm_head.weight (or model.embed_tokens.weight when tied) as the engine stores it
    kv_per_token: int  # K + V bytes of one context token over all layers

    def at_context(self, context_tokens: float) -> float:
        """Bytes read by one decode step attending over `context_tokens` tokens."""
        return self.projections + self.scales + self.lm_head + self.kv_per_token * context_tokens


def decode_bytes(nqfile, lm_head_dtype: str) -> DecodeBytes:
    """Count from an open NanoqwenFile (`open_model(path)`): tensor views' nbytes, no data read.
    lm_head_dtype: "fp16" or "int8", what the engine multiplies at batch 1 (its info["lm_head_dtype"])."""
    names = set(nqfile.tensor_names)
    words = sum(nqfile.tensor(n).nbytes for n in names if n.endswith(".qweight"))
    scales = sum(nqfile.tensor(n).nbytes for n in names if n.endswith(".scales"))
    head = nqfile.tensor("lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight")
    head_bytes = head.nbytes if lm_head_dtype == "fp16" else head.size + FP16_BYTES * (head.size // HEAD_I8_GROUP)
    return DecodeBytes(words, scales, head_bytes, kv_bytes_per_token(nqfile.config))


def kv_bytes_per_token(config: dict) -> int:
    """K and V, fp16, every layer and KV head: 28 x 4 x 128 x 2 x 2 B = 56 KiB for the 7B."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2 * FP16_BYTES
