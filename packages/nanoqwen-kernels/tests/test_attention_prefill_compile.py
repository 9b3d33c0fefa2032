"""CPU (CI): every attention/prefill source compiles for sm_90a with the 7B and tiny dims through the
loader, the decode kernel's SASS holds the instructions its design rests on, launchers refuse bad input."""

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from nanoqwen_kernels import KernelError, ModelDims, loader
from nanoqwen_kernels.attention import (
    DECODE_SOURCES,
    VARIANTS,
    AttentionKernels,
    decode_defines,
    decode_splits,
)
from nanoqwen_kernels.dims import QWEN25_7B, TINY
from nanoqwen_kernels.prefill import PREFILL_SOURCES, PrefillKernels

DIMS = [pytest.param(QWEN25_7B, id="7b"), pytest.param(TINY, id="tiny")]


def cuobjdump() -> str:
    """The disassembler from the nvidia-cuda-cuobjdump wheel (or a CUDA toolkit on PATH)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    for base in {Path(sys.prefix), *(Path(p) for p in sys.path if p.endswith("site-packages"))}:
        for cand in sorted(base.glob("**/nvidia/**/bin/cuobjdump")):
            return str(cand)
    raise AssertionError("cuobjdump not found: `uv pip install nvidia-cuda-cuobjdump` (the nox session does)")


def sass(cubin: bytes, tmp_path: Path) -> str:
    f = tmp_path / "k.cubin"
    f.write_bytes(cubin)
    return subprocess.run([cuobjdump(), "-sass", str(f)], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dims", DIMS)
def test_decode_compiles_with_bulk_copy_and_mbarriers(dims, variant, tmp_path):
    text = sass(loader.compile_cubin(DECODE_SOURCES, decode_defines(dims, variant), "sm_90a"), tmp_path)
    assert "Function : nq_attention_decode\n" in text
    # the cluster fold: one relaxed arrival at the start, its wait before the first remote store and on the
    # idle path (2 waits), the pushes st.async (STAS) counted on the receiver's mbarrier; one ticket atomic,
    # fences around it. tests/test_compile.py checks their order.
    assert text.count("UCGABAR_ARV") == 1 and text.count("UCGABAR_WAIT") == 2, "the fold's cluster barrier"
    assert "STAS.128" in text, "the fold's pushes are not 16-byte st.async"
    assert text.count("ATOMG.E.ADD") == 1 and "MEMBAR.SC.GPU" in text
    # cp.async.bulk global->shared assembles to UBLKCP; mbarrier init/arrive/try_wait to SYNCS.*
    assert "UBLKCP" in text, "the K/V ring is not filled by the bulk copy engine"
    assert "SYNCS.ARRIVE" in text and "SYNCS.PHASECHK" in text, "no mbarrier arrive/wait in the SASS"
    # the score array s[16][G] must live in registers: local memory would mean a run-time index
    assert "LDL" not in text and "STL" not in text, "register spill / local array in the decode kernel"
    if VARIANTS[variant][0]:
        assert "HMMA.16816.F32" in text, "the tensor-core body does not use mma.sync"


@pytest.mark.parametrize("dims", DIMS)
def test_prefill_sources_compile(dims, tmp_path):
    text = sass(loader.compile_cubin(PREFILL_SOURCES, dims.defines(), "sm_90a"), tmp_path)
    kernels = ("nq_dequantize_int4", "nq_rope_kv_prefill", "nq_attention_prefill", "nq_attention_prefill_wg")
    for kernel in kernels:
        assert f"Function : {kernel}" in text
    assert "HGMMA.64x64x16.F32" in text and "tnspB" in text, "attention_prefill_wg off the warpgroup MMAs"
    # the dequantizer unpacks with byte permutes, as the ValueShuffle layout intends
    assert "PRMT" in text


def test_splits_fill_the_gpu():
    # batch 1: one block per SM (7B: 4 KV heads x 33 splits on 132 SMs), as the design wants
    assert decode_splits(QWEN25_7B, 1, 132) * QWEN25_7B.n_kv_heads == 132
    assert decode_splits(TINY, 1, 132) * TINY.n_kv_heads == 132
    for b in (2, 3, 8, 33, 64):  # every batch covers the SMs, and no split more than it must
        s = decode_splits(QWEN25_7B, b, 132)
        assert s * 4 * b >= 132 and (s == 1 or (s - 1) * 4 * b < 132), (b, s)
    assert decode_splits(QWEN25_7B, 64, 132) == 1


class _NoGpuModule:
    """Stands in for a loaded module so launcher argument checks run on a CPU machine."""

    def get_function(self, name, max_dynamic_smem=0):
        return None


def _no_gpu_loader(sources, defines, arch=None):
    return _NoGpuModule()


def test_unknown_variant_is_refused():
    with pytest.raises(KernelError, match="variant"):
        AttentionKernels(TINY, _no_gpu_loader, "wgmma", sms=132)
    with pytest.raises(KernelError, match="variant"):
        PrefillKernels(TINY, _no_gpu_loader, "wgmma")


def test_gqa_above_8_is_refused():
    d = ModelDims(
        hidden=1280, intermediate=256, n_heads=10, n_kv_heads=1, head_dim=128, vocab=10, n_layers=1, rope_theta=1e6
    )
    with pytest.raises(KernelError, match="GQA"):
        AttentionKernels(d, _no_gpu_loader, sms=132)


def test_launchers_refuse_host_arrays():
    ak = AttentionKernels(TINY, _no_gpu_loader, sms=132)
    pk = PrefillKernels(TINY, _no_gpu_loader)
    q = np.zeros(TINY.n_heads * 128, np.float16)
    with pytest.raises(KernelError, match="q must be a CuPy array"):
        ak.attention_decode(q, None, None, None, None, 0, q, None)
    with pytest.raises(KernelError, match="qweight must be a CuPy array"):
        pk.gemm_int4(np.zeros((4, 16), np.uint32), None, None, None)
    with pytest.raises(KernelError, match="qkv must be a CuPy array"):
        pk.rope_kv_prefill(np.zeros((1, TINY.qkv_rows), np.float16), 0, None, None, None, 0, None)
    with pytest.raises(KernelError, match="T must be an int"):
        pk.attention_prefill(None, None, None, None, 0, 1.5, 0, None)
    with pytest.raises(KernelError, match="T = 0 out of range"):
        pk.attention_prefill(None, None, None, None, 0, 0, 0, None)
