"""KernelSet's choice of INT4 GEMV build (CPU: the choice is checked before anything compiles)."""

import pytest
from nanoqwen_kernels import KernelError, KernelSet
from nanoqwen_kernels.dims import ModelDims
from nanoqwen_kernels.gemv import DEFAULT_GEMV_VARIANT, GEMV_VARIANTS, GemvKernels

TINY = ModelDims(hidden=256, intermediate=512, n_heads=2, n_kv_heads=1, head_dim=128, vocab=152064, n_layers=2)


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_unknown_gemv_variant_is_a_clear_error(how, monkeypatch):
    kw = {}
    if how == "argument":
        kw["gemv_variant"] = "fastest"
    else:
        monkeypatch.setenv("NANOQWEN_GEMV_VARIANT", "fastest")
    with pytest.raises(KernelError, match="unknown INT4 GEMV variant 'fastest'.*default, mma, mmaoff, mixed"):
        KernelSet(TINY, arch="sm_90a", **kw)


def test_every_variant_names_only_gemv_knobs():
    assert set(GEMV_VARIANTS) >= {"default", "mma", "mmaoff", "mixed"}
    assert GEMV_VARIANTS["default"] == ({}, {})
    assert DEFAULT_GEMV_VARIANT in GEMV_VARIANTS
    for small, large in GEMV_VARIANTS.values():
        assert all(k.startswith("NQ_GEMV_") for k in {**small, **large})


def test_mixed_builds_the_large_matrices_apart():
    """mixed: o_proj and q/k/v from one build, down and gate/up from the tensor-core build."""
    builds = []

    class Module:
        def __init__(self, defines):
            self.defines = defines

        def get_function(self, name):
            return (name, self.defines.get("NQ_GEMV_MMA", 0))

    def load(sources, defines):
        builds.append((tuple(sources), dict(defines)))
        return Module(defines)

    small, large = GEMV_VARIANTS["mixed"]
    g = GemvKernels(TINY, load, tuning=small, tuning_large=large)
    assert g._h == ("nq_gemv_int4_h", 0) and g._qkv == ("nq_qkv_rope_kv", 0)
    assert g._i == ("nq_gemv_int4_i", 1) and g._gu == ("nq_gate_up_silu", 1)
    assert sum(1 for src, _ in builds if src == ("gemv_int4.cu",)) == 2
