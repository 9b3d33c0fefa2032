"""The NVRTC loader without a GPU: compile for sm_90a, the full cubin, the disk cache, errors."""

import os

import pytest
from nanoqwen_kernels import KernelError, loader
from nanoqwen_kernels.dims import TINY


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A throwaway source file under cuda/ (the loader only reads sources from there)."""
    name = f"_probe_{os.getpid()}_{tmp_path.name}.cu"
    path = loader.CUDA_DIR / name
    path.write_text(
        '#include "common.cuh"\n'
        'extern "C" __global__ void probe(float* o) {\n'
        '  o[threadIdx.x] = NQ_HIDDEN * NQ_ROPE_THETA * nq::kRopeInvFreq[threadIdx.x % 64];\n'
        '}\n'
    )
    monkeypatch.setenv("NANOQWEN_KERNEL_CACHE", str(tmp_path / "cache"))
    yield name
    path.unlink(missing_ok=True)


def test_cubin_is_a_whole_elf(probe):
    cubin = loader.compile_cubin([probe], TINY.defines())
    assert cubin[:4] == b"\x7fELF"
    # the image ends where its header tables end: no byte dropped (cupy's getCUBIN drops one)
    assert loader._elf_size(cubin) == len(cubin)


def test_elf_size_restores_a_dropped_byte(probe):
    cubin = loader.compile_cubin([probe], TINY.defines())
    assert loader._elf_size(cubin[:-1]) == len(cubin)


def test_cache_hit_and_miss(probe, tmp_path, monkeypatch):
    calls = []
    real = loader._get_cubin
    monkeypatch.setattr(loader, "_get_cubin", lambda p: calls.append(p) or real(p))
    a = loader.compile_cubin([probe], TINY.defines())
    assert len(calls) == 1
    files = list((tmp_path / "cache").glob("*.cubin"))
    assert len(files) == 1 and files[0].read_bytes() == a
    b = loader.compile_cubin([probe], TINY.defines())
    assert a == b and len(calls) == 1, "second compile of the same sources must hit the cache"
    d = dict(TINY.defines(), NQ_HIDDEN=512)
    loader.compile_cubin([probe], d)
    assert len(calls) == 2, "a changed define must miss the cache"
    assert len(list((tmp_path / "cache").glob("*.cubin"))) == 2
    assert not list((tmp_path / "cache").glob(".tmp-*")), "no temporary file left behind"


def test_header_or_arch_change_misses(probe, tmp_path):
    """A header the source includes, edited, or another arch: a new cubin, not the cached one."""
    header = loader.CUDA_DIR / probe.replace(".cu", ".cuh")
    src = loader.CUDA_DIR / probe
    src.write_text(f'#include "{header.name}"\n' + src.read_text().replace("NQ_HIDDEN", "PROBE_SCALE * NQ_HIDDEN"))
    try:
        header.write_text("#pragma once\n#define PROBE_SCALE 2\n")
        first = loader.compile_cubin([probe], TINY.defines())
        header.write_text("#pragma once\n#define PROBE_SCALE 3\n")
        edited = loader.compile_cubin([probe], TINY.defines())
        other_arch = loader.compile_cubin([probe], TINY.defines(), "sm_90")
    finally:
        header.unlink()
    assert first != edited, "the header's edit did not reach the cubin (a stale cache hit)"
    assert len(list((tmp_path / "cache").glob("*.cubin"))) == 3
    assert other_arch not in (first, edited)


def test_compile_error_carries_the_log(probe):
    (loader.CUDA_DIR / probe).write_text('extern "C" __global__ void probe() { this_is_not_cuda; }\n')
    with pytest.raises(KernelError, match="this_is_not_cuda"):
        loader.compile_cubin([probe], TINY.defines())


def test_missing_dims_is_a_compile_error(probe):
    with pytest.raises(KernelError, match="NQ_HIDDEN not defined"):
        loader.compile_cubin([probe], {})


def test_bad_inputs():
    with pytest.raises(KernelError, match="no kernel source"):
        loader.compile_cubin(["nope.cu"], TINY.defines())
    with pytest.raises(KernelError, match="at least one"):
        loader.compile_cubin([], TINY.defines())
    with pytest.raises(KernelError, match="define"):
        loader.compile_cubin(["common.cuh"], {"X": "1"})


def test_debug_adds_lineinfo(monkeypatch):
    monkeypatch.setenv("NANOQWEN_JIT_DEBUG", "1")
    assert "-lineinfo" in loader.build_options({}, "sm_90a")
    monkeypatch.delenv("NANOQWEN_JIT_DEBUG")
    assert "-lineinfo" not in loader.build_options({}, "sm_90a")


def test_gpu_status_never_raises():
    from nanoqwen_kernels import gpu_status

    ok, reason = gpu_status()
    assert isinstance(ok, bool) and reason


def test_extra_defines_from_env_enter_the_options(monkeypatch):
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", "NQ_TILE_PRODUCERS=0, NQ_GEMV_STAGE_PIECES=2")
    opts = loader.build_options({"NQ_HIDDEN": 64}, "sm_90a")
    assert "-DNQ_TILE_PRODUCERS=0" in opts and "-DNQ_GEMV_STAGE_PIECES=2" in opts and "-DNQ_HIDDEN=64" in opts
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", "NQ_TILE_PRODUCERS")
    with pytest.raises(KernelError, match="NAME=INT"):
        loader.build_options({}, "sm_90a")
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", "NQ_X=fast")
    with pytest.raises(KernelError, match="NAME=INT"):
        loader.build_options({}, "sm_90a")


def test_define_values():
    """-D constants: an int, a float (kept a float by its suffix, exactly), or a non-empty tuple of floats
    (an initializer list); anything else is refused by name before NVRTC sees it."""
    assert loader._format_define("NQ_A", 3) == "-DNQ_A=3"
    assert loader._format_define("NQ_B", 0.1) == "-DNQ_B=0.1f"
    assert loader._format_define("NQ_T", (1.0, 0.5)) == "-DNQ_T=1.0f,0.5f"
    for bad in (True, "3", (), (1, 2), (1.0, "x"), [1.0]):
        with pytest.raises(KernelError, match="NQ_X must be an int, a float or a tuple of floats"):
            loader._format_define("NQ_X", bad)
    with pytest.raises(KernelError, match="not a C identifier"):
        loader._format_define("NQ-X", 1)


def test_a_loaded_module_is_keyed_on_the_extra_defines_too(monkeypatch):
    """load_module's in-process cache holds a module under every define compiled into it, so a launcher built
    under other $NANOQWEN_KERNEL_DEFINES in the same process (the GEMV tests' split and cluster builds) loads
    its own build, not the module first loaded from the same sources and base defines."""
    base = {"NQ_HIDDEN": 256}
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", "")
    plain = loader.module_key(["gemv_int4.cu"], base)
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", "NQ_QKV_CLUSTER=2")
    knob = loader.module_key(["gemv_int4.cu"], base)
    assert plain != knob and ("NQ_QKV_CLUSTER", 2) in knob[1]
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", "NQ_HIDDEN=256")  # the same build: the same key
    assert loader.module_key(["gemv_int4.cu"], base) == plain
