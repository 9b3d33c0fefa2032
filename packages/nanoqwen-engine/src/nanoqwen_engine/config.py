"""ModelConfig: the numbers the engine needs, read once from the HF config and generation_config dicts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ConfigError


def _as_id_list(v: Any) -> list[int]:
    if v is None:
        return []
    if isinstance(v, int):
        return [v]
    return [int(x) for x in v]


@dataclass(frozen=True)
class ModelConfig:
    hidden: int  # H
    intermediate: int  # I (MLP)
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int  # K/V heads (GQA: n_heads % n_kv_heads == 0)
    head_dim: int  # hidden // n_heads (128 for every Qwen2.5 size)
    vocab: int  # V: rows of embed_tokens / lm_head
    rms_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position: int  # max_position_embeddings: the longest context the model was trained for
    eos_ids: tuple[int, ...]  # union of config and generation_config eos ids, in order of first mention

    @classmethod
    def from_hf(cls, config: dict, generation_config: dict | None = None) -> ModelConfig:
        """Build from the HF `config.json` dict (and `generation_config.json`, whose eos ids are added).

        Raises ConfigError naming the first missing or inconsistent key.
        """
        need = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
        for k in need:
            if k not in config:
                raise ConfigError(f"model config lacks {k!r}")
        hidden = int(config["hidden_size"])
        n_heads = int(config["num_attention_heads"])
        n_kv = int(config.get("num_key_value_heads", n_heads))
        if hidden % n_heads:
            raise ConfigError(f"hidden_size {hidden} is not a multiple of num_attention_heads {n_heads}")
        if n_heads % n_kv:
            raise ConfigError(f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
        if config.get("model_type", "qwen2") != "qwen2":
            raise ConfigError(f"model_type {config.get('model_type')!r} is not qwen2")
        eos: list[int] = []
        for v in _as_id_list(config.get("eos_token_id")) + _as_id_list(
            (generation_config or {}).get("eos_token_id")
        ):
            if v not in eos:
                eos.append(v)
        return cls(
            hidden=hidden,
            intermediate=int(config["intermediate_size"]),
            n_layers=int(config["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=hidden // n_heads,
            vocab=int(config["vocab_size"]),
            rms_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position=int(config.get("max_position_embeddings", 32768)),
            eos_ids=tuple(eos),
        )

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim
