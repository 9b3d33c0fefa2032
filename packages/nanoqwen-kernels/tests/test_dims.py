"""ModelDims: the whitelist of shapes the kernels are built for, and from_config."""

import json
from pathlib import Path

import pytest
from nanoqwen_kernels import KernelError, ModelDims
from nanoqwen_kernels.dims import QWEN25_7B, TINY

CFG_7B = Path(__file__).resolve().parents[3] / (
    "packages/nanoqwen-format/src/nanoqwen_format/data/qwen2.5-coder-7b-instruct/config.json"
)


def test_7b_config_round_trips():
    cfg = json.loads(CFG_7B.read_text())
    d = ModelDims.from_config(cfg)
    assert d == ModelDims(3584, 18944, 28, 4, 128, cfg["vocab_size"], 28, float(cfg["rope_theta"]))
    assert d.qkv_rows == 3584 + 2 * 512
    assert d.defines()["NQ_HIDDEN"] == 3584


def test_presets_pass():
    assert QWEN25_7B.kv_dim == 512 and TINY.q_dim == 256


@pytest.mark.parametrize(
    "kw, word",
    [
        (dict(head_dim=64), "head_dim"),
        (dict(hidden=300), "hidden"),
        (dict(intermediate=500), "intermediate"),
        (dict(n_heads=3, n_kv_heads=2), "n_heads"),
        (dict(vocab=0), "vocab"),
        (dict(n_layers=-1), "n_layers"),
        (dict(rope_theta=0.0), "rope_theta"),
    ],
)
def test_unsupported_dims_raise_naming_the_dim(kw, word):
    base = dict(hidden=256, intermediate=512, n_heads=2, n_kv_heads=1, head_dim=128, vocab=1000, n_layers=2)
    base.update(kw)
    with pytest.raises(KernelError, match=word):
        ModelDims(**base)


def test_from_config_missing_key():
    with pytest.raises(KernelError, match="intermediate_size"):
        ModelDims.from_config({"hidden_size": 256, "num_attention_heads": 2})
