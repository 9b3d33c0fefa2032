"""KernelSet's choice of INT4 GEMV build (CPU: the choice is checked before anything compiles)."""

import pytest
from nanoqwen_kernels import KernelError, KernelSet
from nanoqwen_kernels.dims import ModelDims
from nanoqwen_kernels.gemv import GEMV_VARIANTS

TINY = ModelDims(hidden=256, intermediate=512, n_heads=2, n_kv_heads=1, head_dim=128, vocab=152064, n_layers=2)


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_unknown_gemv_variant_is_a_clear_error(how, monkeypatch):
    kw = {}
    if how == "argument":
        kw["gemv_variant"] = "fastest"
    else:
        monkeypatch.setenv("NANOQWEN_GEMV_VARIANT", "fastest")
    with pytest.raises(KernelError, match="unknown INT4 GEMV variant 'fastest'.*default, mma, mmaoff"):
        KernelSet(TINY, arch="sm_90a", **kw)


def test_every_variant_names_only_gemv_knobs():
    assert set(GEMV_VARIANTS) >= {"default", "mma", "mmaoff"}
    assert GEMV_VARIANTS["default"] == {}
    for knobs in GEMV_VARIANTS.values():
        assert all(k.startswith("NQ_GEMV_") for k in knobs)
