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
