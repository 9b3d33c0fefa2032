"""Synthetic models: configs, and the weight scales checked with a float64 Qwen2 forward written here.

The scales must make greedy decoding meaningful (top-2 logit margins well above fp16 noise, ~1e-2) while
the residual stream stays in the tens through 28 layers (fp16 max is 65504).
"""

import json

import numpy as np
import pytest
from nanoqwen_format import open_model, tiny_config, write_synthetic
from nanoqwen_format.synthetic import qwen7b_config, write_hf_checkpoint


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, theta):
    """x [T, heads, 128]: HF rotate-half RoPE."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # [64]
    ang = pos[:, None] * inv[None, :]  # [T, 64]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def forward(m, ids):
    """float64 Qwen2 forward over all positions; returns (logits [T, V], max |activation| seen, residual rms)."""
    c = m.config
    eps, theta = c["rms_norm_eps"], c["rope_theta"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c["hidden_size"] // nh

    def W(name):
        return m.dequantize(name).astype(np.float64)

    h = W("model.embed_tokens.weight")[ids]  # [T, H]
    T, peak = len(ids), 0.0
    pos = np.arange(T, dtype=np.float64)
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        x = rmsnorm(h, W(f"{p}.input_layernorm.weight"), eps)
        q = x @ W(f"{p}.self_attn.q_proj.weight").T + W(f"{p}.self_attn.q_proj.bias")
        k = x @ W(f"{p}.self_attn.k_proj.weight").T + W(f"{p}.self_attn.k_proj.bias")
        v = x @ W(f"{p}.self_attn.v_proj.weight").T + W(f"{p}.self_attn.v_proj.bias")
        q = rope(q.reshape(T, nh, hd), pos, theta)
        k = np.repeat(rope(k.reshape(T, nkv, hd), pos, theta), nh // nkv, axis=1)
        v = np.repeat(v.reshape(T, nkv, hd), nh // nkv, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", a, v).reshape(T, nh * hd)
        h = h + o @ W(f"{p}.self_attn.o_proj.weight").T
        x = rmsnorm(h, W(f"{p}.post_attention_layernorm.weight"), eps)
        g, u = x @ W(f"{p}.mlp.gate_proj.weight").T, x @ W(f"{p}.mlp.up_proj.weight").T
        mlp = g / (1 + np.exp(-g)) * u
        h = h + mlp @ W(f"{p}.mlp.down_proj.weight").T
        peak = max(peak, *(float(np.abs(t).max()) for t in (h, q, k, v, s[np.isfinite(s)], g, u, mlp)))
    x = rmsnorm(h, W("model.norm.weight"), eps)
    return x @ W("lm_head.weight").T, peak, float(np.sqrt(np.mean(h * h)))


def top2_margins(logits):
    top = np.sort(logits, axis=-1)[:, -2:]
    return top[:, 1] - top[:, 0]


@pytest.mark.parametrize("tied", [False, True])
def test_28_layers_stay_finite_and_decisive(tmp_path, tied, seed, rng):
    config = tiny_config(num_hidden_layers=28, vocab_size=8192, tie_word_embeddings=tied)
    path = write_synthetic(tmp_path / "m.nanoqwen", config, seed=seed)
    with open_model(path, verify=True) as m:
        logits, peak, rms = forward(m, rng.integers(0, 8192, size=12))
    assert np.all(np.isfinite(logits))
    assert peak < 1000, f"largest activation {peak} (fp16 needs headroom below 65504)"
    assert 1 < rms < 40, f"residual rms {rms} after 28 layers"
    std = float(logits.std(axis=-1).mean())
    assert 1.5 < std < 12, f"logit std {std}"
    margins = top2_margins(logits)
    assert np.median(margins) > 0.1 and np.mean(margins > 0.02) >= 0.75, f"top-2 margins {margins}"


def test_default_tiny_model_full_vocab(tmp_path, seed):
    config = tiny_config()
    assert config["vocab_size"] == 152064 and config["hidden_size"] // config["num_attention_heads"] == 128
    path = write_synthetic(tmp_path / "tiny.nanoqwen", config, seed=seed)
    with open_model(path) as m:
        assert m.tokenizer_json.startswith("{") and "<|im_end|>" in m.tokenizer_json
        assert "chat_template" in m.tokenizer_config and m.generation_config["eos_token_id"] == [151645, 151643]
        logits, peak, _ = forward(m, np.array([151644, 872, 198, 151645, 151643]))
    assert peak < 1000 and np.median(top2_margins(logits)) > 0.1


def test_tiny_config_shape_and_overrides():
    seven = qwen7b_config()
    assert seven["hidden_size"] == 3584 and seven["num_hidden_layers"] == 28
    c = tiny_config(tie_word_embeddings=True, num_hidden_layers=3)
    assert (c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]) == (
        256, 512, 2, 1)
    assert c["tie_word_embeddings"] is True and c["num_hidden_layers"] == c["max_window_layers"] == 3
    assert c["rope_theta"] == seven["rope_theta"] and c["architectures"] == ["Qwen2ForCausalLM"]


def test_seed_decides_the_weights(tmp_path):
    config = tiny_config(vocab_size=1024)
    a = write_synthetic(tmp_path / "a.nanoqwen", config, seed=5)
    b = write_synthetic(tmp_path / "b.nanoqwen", config, seed=5)
    c = write_synthetic(tmp_path / "c.nanoqwen", config, seed=6)
    name = "model.layers.1.mlp.up_proj.qweight"
    with open_model(a) as ma, open_model(b) as mb, open_model(c) as mc:
        assert np.array_equal(ma.tensor(name), mb.tensor(name))
        assert not np.array_equal(ma.tensor(name), mc.tensor(name))


def test_hf_checkpoint_layout(tmp_path):
    config = tiny_config(vocab_size=1024, tie_word_embeddings=True)
    d = write_hf_checkpoint(tmp_path / "hf", config, seed=1, dtype="float16", shards=2)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert "lm_head.weight" not in index["weight_map"]  # tied, as real tied checkpoints are
    assert json.loads((d / "config.json").read_text())["torch_dtype"] == "float16"
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (d / f).stat().st_size > 0
