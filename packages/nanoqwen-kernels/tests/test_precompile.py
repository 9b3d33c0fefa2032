"""bench/precompile.py lists every build the launchers load without a GPU (what
scripts/kernel_cache_for_device.sh relies on to compile them on the CPU machine), and leaves the launch
helpers it stands in for as they were."""

import importlib.util
from pathlib import Path

from nanoqwen_kernels import checks
from nanoqwen_kernels.dims import PRESETS
from nanoqwen_kernels.gemv_b1 import b1_build_defines

BENCH = Path(__file__).resolve().parents[1] / "bench" / "precompile.py"


def _precompile():
    spec = importlib.util.spec_from_file_location("precompile", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_7b_short_context_build_is_listed():
    """The 7B's short-context GEMV build (q/k/v's and gate/up's prologues over clusters) is a build of its own."""
    found = _precompile().builds(["7b"])
    int4 = [dict(defines) for srcs, defines in found if srcs == ("gemv_int4.cu",)]
    assert sum(d.get("NQ_QKV_CLUSTER") == 2 and d.get("NQ_GU_CLUSTER") == 2 for d in int4) == 1
    assert sum("NQ_QKV_CLUSTER" not in d for d in int4) == 2  # the fp16-loop build and the int8 default


def test_builds_are_listed_without_a_gpu():
    before = checks.sm_count, checks.cupy_module
    found = _precompile().builds(["tiny", "1.5b"])
    assert (checks.sm_count, checks.cupy_module) == before
    sources = {s for build in found for s in build[0]}
    for name in ("gemv_int4.cu", "gemv_fp16.cu", "attention_decode.cu", "rmsnorm.cu", "embed.cu", "sampling.cu",
                 "gemm_int4_prefill.cu", "gemm_fp8_prefill.cu"):
        assert name in sources, name
    hidden = {dict(defines)["NQ_HIDDEN"] for _, defines in found}
    assert hidden == {PRESETS["tiny"].hidden, PRESETS["1.5b"].hidden}
    # gemv_int4: one build per shape (the launchers pick variants by entry name), and beside it the int8
    # loop's build where gemv_b1.b1_build_defines adds its split and trigger defines (both these dims: their
    # o_proj / down_proj grids leave an H200's SMs empty)
    # (their short-context build is the default one: gemv_b1.b1_short_defines adds nothing on small grids)
    int4 = [dict(defines) for srcs, defines in found if srcs == ("gemv_int4.cu",)]
    assert len(int4) == 4
    for name in ("tiny", "1.5b"):
        mine = [d for d in int4 if d["NQ_HIDDEN"] == PRESETS[name].hidden]
        assert sorted("NQ_SPLIT_DOWN" in d for d in mine) == [False, True], name
        assert {d.get("NQ_SPLIT_DOWN") for d in mine} == {None, b1_build_defines(PRESETS[name], 132)["NQ_SPLIT_DOWN"]}
