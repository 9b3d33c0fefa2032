"""ModelDims: the whitelist of shapes the kernels are built for, and the named shapes."""

import pytest
from nanoqwen_kernels import KernelError, ModelDims
from nanoqwen_kernels.dims import PRESETS, QWEN25_1_5B, QWEN25_7B, TINY


def test_named_shapes():
    assert QWEN25_7B.qkv_rows == 3584 + 2 * 512 and QWEN25_7B.kv_dim == 512
    assert QWEN25_1_5B.qkv_rows == 1536 + 2 * 256 and QWEN25_1_5B.n_heads // QWEN25_1_5B.n_kv_heads == 6
    assert TINY.q_dim == 256
    assert set(PRESETS.values()) == {QWEN25_7B, QWEN25_1_5B, TINY}
    assert QWEN25_7B.defines()["NQ_HIDDEN"] == 3584 and QWEN25_7B.defines()["NQ_ROPE_THETA"] == 1e6


BASE = dict(hidden=256, intermediate=512, n_heads=2, n_kv_heads=1, head_dim=128, vocab=1000, n_layers=2,
            rope_theta=1e6)


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
    with pytest.raises(KernelError, match=word):
        ModelDims(**{**BASE, **kw})


def test_rope_theta_has_no_default():
    """The model's config is the one source of theta (the engine passes it): no silent default here."""
    kw = dict(BASE)
    del kw["rope_theta"]
    with pytest.raises(TypeError, match="rope_theta"):
        ModelDims(**kw)
