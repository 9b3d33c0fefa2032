"""ModelConfig from the shipped Qwen2.5-Coder-7B config and generation_config, and its errors."""

from __future__ import annotations

import pytest
from nanoqwen_engine import ConfigError
from nanoqwen_engine.config import ModelConfig
from nanoqwen_format.synthetic import qwen7b_config, shipped_tokenizer


def test_7b_config():
    gen = shipped_tokenizer()[2]
    c = ModelConfig.from_hf(qwen7b_config(), gen)
    assert (c.hidden, c.intermediate, c.n_layers, c.n_heads, c.n_kv_heads) == (3584, 18944, 28, 28, 4)
    assert c.head_dim == 3584 // 28 == 128 and c.q_dim == 3584 and c.kv_dim == 512
    assert (c.vocab, c.rms_eps, c.rope_theta, c.tie_word_embeddings) == (152064, 1e-6, 1e6, False)
    # config says 151645; generation_config adds 151643 (<|endoftext|>)
    assert c.eos_ids == (151645, 151643)


@pytest.mark.parametrize("change, match", [
    ({"hidden_size": None}, "hidden_size"),
    ({"num_attention_heads": 5}, "multiple of num_attention_heads"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"model_type": "llama"}, "qwen2"),
])
def test_bad_configs_name_the_key(change, match):
    cfg = qwen7b_config()
    for k, v in change.items():
        if v is None:
            del cfg[k]
        else:
            cfg[k] = v
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf(cfg)


@pytest.mark.parametrize("change, match", [
    ({"eos_token_id": "abc"}, "config.eos_token_id"), ({"eos_token_id": [None]}, "config.eos_token_id"),
    ({"eos_token_id": [1.5]}, "config.eos_token_id"), ({"max_position_embeddings": "x"}, "max_position_embeddings"),
    ({"max_position_embeddings": 0}, "max_position_embeddings"), ({"hidden_size": "3584"}, "hidden_size"),
    ({"hidden_size": 3584.0}, "hidden_size"), ({"num_hidden_layers": True}, "num_hidden_layers"),
    ({"vocab_size": -1}, "vocab_size"), ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    ({"rope_theta": "1e6"}, "rope_theta"), ({"rope_theta": 0}, "rope_theta"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings"), ({"hidden_size": 2**40}, "hidden_size"),
])
def test_bad_config_values_are_config_errors_naming_the_key(change, match):
    from nanoqwen_engine import ModelFormatError

    cfg = {**qwen7b_config(), **change}
    with pytest.raises(ConfigError, match=match) as e:
        ModelConfig.from_hf(cfg)
    assert isinstance(e.value, ModelFormatError)


def test_generation_config_eos_must_be_ids():
    with pytest.raises(ConfigError, match="generation_config.eos_token_id"):
        ModelConfig.from_hf(qwen7b_config(), {"eos_token_id": ["x"]})
    with pytest.raises(ConfigError, match="JSON object"):
        ModelConfig.from_hf(qwen7b_config(), [1, 2])


def test_head_dim_is_read_when_given_and_defaults_follow_hf():
    cfg = qwen7b_config()
    assert ModelConfig.from_hf({**cfg, "head_dim": 64}).head_dim == 64
    bare = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rms_norm_eps", "max_position_embeddings")}
    c = ModelConfig.from_hf(bare)
    assert (c.rope_theta, c.rms_eps, c.max_position) == (10000.0, 1e-6, 32768)  # HF Qwen2Config's defaults
