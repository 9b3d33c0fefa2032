"""Napkin math for decode: the bytes one token must read, from the file's own tensor table.

One decode step of batch 1 reads every INT4 projection (packed words + fp16 scales) once, the fp16
lm_head (the tied embedding for small models) once, and the K/V of every token in the context; the
rest (norms, biases, one embedding row) is a few hundred KiB and is left out. Achieved bandwidth is
those bytes divided by the measured time per token; for the 7B that is 4.46 GB + 56 KiB per token
of context.
"""

from __future__ import annotations

from dataclasses import dataclass

PROJECTION_SUFFIXES = (".qweight", ".scales")
FP16_BYTES = 2


@dataclass(frozen=True)
class DecodeBytes:
    projections: int  # INT4 words of every q/k/v/o/gate/up/down projection
    scales: int  # their fp16 group scales
    lm_head: int  # lm_head.weight, or model.embed_tokens.weight when the embeddings are tied
    kv_per_token: int  # K + V bytes of one context token over all layers

    def at_context(self, context_tokens: float) -> float:
        """Bytes read by one decode step attending over `context_tokens` tokens."""
        return self.projections + self.scales + self.lm_head + self.kv_per_token * context_tokens


def decode_bytes(nqfile) -> DecodeBytes:
    """Count from an open NanoqwenFile (`open_model(path)`): tensor views' nbytes, no data read."""
    names = set(nqfile.tensor_names)
    words = sum(nqfile.tensor(n).nbytes for n in names if n.endswith(".qweight"))
    scales = sum(nqfile.tensor(n).nbytes for n in names if n.endswith(".scales"))
    head = "lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight"
    return DecodeBytes(words, scales, nqfile.tensor(head).nbytes, kv_bytes_per_token(nqfile.config))


def kv_bytes_per_token(config: dict) -> int:
    """K and V, fp16, every layer and KV head: 28 x 4 x 128 x 2 x 2 B = 56 KiB for the 7B."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2 * FP16_BYTES
