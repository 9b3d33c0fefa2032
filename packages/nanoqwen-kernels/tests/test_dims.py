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


def test_rope_table_is_the_references_fp32_inv_freq():
    """NQ_ROPE_INV_FREQ: 1 / theta^(2d/128) in fp64, rounded once to fp32, as the reference backend's
    rope_tables computes it; the -D string parses back to exactly those fp32 values."""
    import numpy as np
    from nanoqwen_kernels import loader

    for dims in (QWEN25_7B, ModelDims(**dict(BASE, rope_theta=10000.0))):
        want = (1.0 / (dims.rope_theta ** (np.arange(0, 128, 2, dtype=np.float64) / 128))).astype(np.float32)
        got = dims.defines()["NQ_ROPE_INV_FREQ"]
        assert isinstance(got, tuple) and len(got) == 64 and np.array_equal(np.array(got, np.float32), want)
        opt = loader._format_define("NQ_ROPE_INV_FREQ", got)
        parsed = np.array([float(v.rstrip("f")) for v in opt.split("=", 1)[1].split(",")], dtype=np.float32)
        assert np.array_equal(parsed, want)
    assert ModelDims(**dict(BASE, rope_theta=10000.0)).rope_inv_freq() != QWEN25_7B.rope_inv_freq()


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
