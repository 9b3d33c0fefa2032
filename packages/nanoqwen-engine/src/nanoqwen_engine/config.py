"""ModelConfig: the numbers the engine needs, read once from the HF config and generation_config dicts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanoqwen_kernels.dims import HeadWidths

from .argcheck import check_bool, check_float, check_int, is_int
from .errors import ConfigError

# HF Qwen2Config's defaults, for the keys a config.json may leave out.
DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "max_position_embeddings": 32768}
MAX_DIM = 1 << 20  # no Qwen2 dimension comes near this; it bounds products computed from the numbers


def _eos_ids(where: str, v: Any) -> list[int]:
    """eos_token_id: absent/null, one id, or a list of ids, each >= 0. An id at or past the vocabulary
    is allowed (small test models keep the real tokenizer's eos ids): the model never emits it."""
    if v is None:
        return []
    items = v if isinstance(v, list) else [v]
    out = []
    for x in items:
        if not is_int(x) or int(x) < 0:
            raise ConfigError(f"{where}.eos_token_id must be token ids >= 0 (an id or a list), got {v!r}")
        out.append(int(x))
    return out


@dataclass(frozen=True)
class ModelConfig(HeadWidths):
    """The one parse of a model's HF config in the engine; every backend (and the GPU kernels' dims)
    is built from it. q_dim, kv_dim and qkv_rows come from HeadWidths."""

    hidden: int  # H
    intermediate: int  # I (MLP)
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int  # K/V heads (GQA: n_heads % n_kv_heads == 0)
    head_dim: int  # config's head_dim, else hidden // n_heads (128 for every Qwen2.5 size)
    vocab: int  # V: rows of embed_tokens / lm_head
    rms_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position: int  # max_position_embeddings: the longest context the model was trained for
    eos_ids: tuple[int, ...]  # union of config and generation_config eos ids, in order of first mention

    @classmethod
    def from_hf(cls, config: dict, generation_config: dict | None = None) -> ModelConfig:
        """Build from the HF `config.json` dict (and `generation_config.json`, whose eos ids are added).

        Raises ConfigError (a ModelFormatError) naming the first missing, mistyped, out-of-range or
        inconsistent key. Absent optional keys take HF Qwen2Config's defaults (DEFAULTS).
        """
        if not isinstance(config, dict):
            raise ConfigError(f"model config must be a JSON object, got {type(config).__name__}")
        if generation_config is not None and not isinstance(generation_config, dict):
            raise ConfigError(f"generation_config must be a JSON object, got {type(generation_config).__name__}")
        if config.get("model_type", "qwen2") != "qwen2":
            raise ConfigError(f"model_type {config.get('model_type')!r} is not qwen2")

        def dim(key: str) -> int:
            if key not in config:
                raise ConfigError(f"model config lacks {key!r}")
            return check_int(f"config.{key}", config[key], ConfigError, lo=1, hi=MAX_DIM)

        hidden = dim("hidden_size")
        n_heads = dim("num_attention_heads")
        n_kv = dim("num_key_value_heads") if "num_key_value_heads" in config else n_heads
        if "head_dim" in config and config["head_dim"] is not None:
            head_dim = dim("head_dim")
        else:
            if hidden % n_heads:
                raise ConfigError(f"hidden_size {hidden} is not a multiple of num_attention_heads {n_heads}")
            head_dim = hidden // n_heads
        if n_heads % n_kv:
            raise ConfigError(f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
        vocab = dim("vocab_size")

        def opt(key: str):
            v = config.get(key)
            return DEFAULTS[key] if v is None else v

        eps = check_float("config.rms_norm_eps", opt("rms_norm_eps"), ConfigError)
        theta = check_float("config.rope_theta", opt("rope_theta"), ConfigError)
        if not 0 < eps < 1:
            raise ConfigError(f"config.rms_norm_eps must be in (0, 1), got {eps}")
        if theta <= 0:
            raise ConfigError(f"config.rope_theta must be > 0, got {theta}")
        eos: list[int] = []
        for v in _eos_ids("config", config.get("eos_token_id")) + _eos_ids(
            "generation_config", (generation_config or {}).get("eos_token_id")
        ):
            if v not in eos:
                eos.append(v)
        return cls(
            hidden=hidden,
            intermediate=dim("intermediate_size"),
            n_layers=dim("num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            vocab=vocab,
            rms_eps=eps,
            rope_theta=theta,
            tie_word_embeddings=check_bool("config.tie_word_embeddings", opt("tie_word_embeddings"), ConfigError),
            max_position=check_int("config.max_position_embeddings", opt("max_position_embeddings"), ConfigError,
                                   lo=1),
            eos_ids=tuple(eos),
        )
