"""Every kernel source compiles with NVRTC for sm_90a (no GPU needed) for the 7B and the tiny dims, and
the SASS holds what the designs rely on."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from nanoqwen_kernels import loader
from nanoqwen_kernels.dims import QWEN25_7B, TINY

SOURCES = sorted(p.name for p in loader.CUDA_DIR.glob("*.cu") if not p.name.startswith("_"))
DIMS = {"7b": QWEN25_7B, "tiny": TINY}


def _defines(source: str, dims):
    if source.startswith("attention_decode"):  # part B's build adds its split/stage constants
        from nanoqwen_kernels.attention import decode_defines

        return decode_defines(dims)
    return dims.defines()


@pytest.mark.parametrize("dims_name", sorted(DIMS))
@pytest.mark.parametrize("source", SOURCES)
def test_compiles_for_sm90a(source, dims_name):
    cubin = loader.compile_cubin([source], _defines(source, DIMS[dims_name]), "sm_90a")
    assert cubin[:4] == b"\x7fELF" and loader._elf_size(cubin) == len(cubin)


def _tool(name: str) -> str:
    """cuobjdump/nvdisasm from the NVIDIA wheels (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm) or PATH."""
    site = Path(loader.__file__).resolve().parents[1]
    roots = [Path(p) for p in sys.path if p] + [site, Path(sys.prefix)]
    for root in roots:
        for cand in sorted((root / "nvidia").glob(f"*/bin/{name}")) if (root / "nvidia").is_dir() else []:
            return str(cand)
    found = shutil.which(name)
    if not found:
        pytest.fail(
            f"{name} not found: install nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm (the kernels "
            "nox session's SASS check needs both)"
        )
    return found


def _sass(source: str, dims) -> str:
    cuobjdump, nvdisasm = _tool("cuobjdump"), _tool("nvdisasm")
    cubin = loader.compile_cubin([source], _defines(source, dims), "sm_90a")
    path = Path(os.environ["NANOQWEN_KERNEL_CACHE"]) / f"sass-{source}-{dims.hidden}.cubin"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(cubin)
    env = dict(os.environ, PATH=f"{Path(nvdisasm).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    out = subprocess.run(
        [cuobjdump, "-sass", str(path)], capture_output=True, text=True, env=env, check=False
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def _functions(sass: str) -> dict[str, str]:
    parts = sass.split("Function : ")[1:]
    return {p.split("\n", 1)[0].strip(): p for p in parts}


def test_gemv_int4_sass_uses_prmt_and_streaming_loads():
    funcs = _functions(_sass("gemv_int4.cu", QWEN25_7B))
    assert set(funcs) == {"nq_gemv_int4_h", "nq_gemv_int4_i", "nq_qkv_rope_kv", "nq_gate_up_silu"}
    for name, body in funcs.items():
        # the ValueShuffle unpack is byte permutes, not shift-and-mask per nibble
        assert body.count("PRMT") >= 16, f"{name}: expected the prmt unpack"
        # weights: 16-byte non-coherent loads that do not allocate in L1
        assert "LDG.E.NA" in body and ".128" in body, f"{name}: expected 16-byte no-allocate weight loads"
        # no register spills. nq_qkv_rope_kv is exempt: sincosf's slow-path argument reduction keeps a
        # small local array (cuobjdump -res-usage: STACK 32); it runs only for |angle| > ~1e5 rad
        # (beyond pos 32k * inv_freq 1.0) and only in lane 0's epilogue, never in the K loop
        if name != "nq_qkv_rope_kv":
            assert "STL" not in body and "LDL" not in body, f"{name}: local-memory spill"


def test_gemv_fp16_sass_streams_16_byte_pieces():
    body = _functions(_sass("gemv_fp16.cu", QWEN25_7B))["nq_gemv_fp16"]
    assert "LDG.E.NA" in body and ".128" in body
    assert "STL" not in body and "LDL" not in body


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("dims_name", sorted(DIMS))
def test_gemv_int4_mma_variant(dims_name, offset):
    """The opt-in tensor-core build (gemv_int4_mma.cuh) compiles; at 7B its SASS holds HMMA and PRMT."""
    defines = {**DIMS[dims_name].defines(), "NQ_GEMV_MMA": 1, "NQ_GEMV_MMA_OFFSET": offset}
    cubin = loader.compile_cubin(["gemv_int4.cu"], defines, "sm_90a")
    assert loader._elf_size(cubin) == len(cubin)
    if dims_name != "7b":
        return
    path = Path(os.environ["NANOQWEN_KERNEL_CACHE"]) / f"sass-mma-{offset}.cubin"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(cubin)
    nvdisasm = _tool("nvdisasm")
    env = dict(os.environ, PATH=f"{Path(nvdisasm).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    out = subprocess.run([_tool("cuobjdump"), "-sass", str(path)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    for name, body in _functions(out.stdout).items():
        assert "HMMA.16816.F32" in body, f"{name}: expected the tensor-core dot product"
        assert body.count("PRMT") >= 16, f"{name}: expected the prmt unpack"
