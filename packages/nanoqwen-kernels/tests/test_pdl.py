"""The PDL launch path (pdl.py) on a CPU: the driver structs have cuda.h's layout, arguments are
marshalled as CuPy would (pointer, int32, float32, the null pointer), bad arguments are refused by name,
and the switch reads $NANOQWEN_PDL. The launches themselves run in every GPU test (on by default)."""

import ctypes

import numpy as np
import pytest
from nanoqwen_kernels import checks, pdl
from nanoqwen_kernels.errors import KernelError


class _Dev:
    def __init__(self, ptr):
        self.data = type("P", (), {"ptr": ptr})()


def test_struct_layout_matches_cuda_h():
    # CUlaunchAttribute: id (4) + pad (4) + 64-byte union; CUlaunchConfig: 7 x uint32, pad, stream,
    # attrs pointer, numAttrs, pad (x86-64 / aarch64 LP64)
    assert ctypes.sizeof(pdl.LaunchAttribute) == 72
    assert pdl.LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(pdl.LaunchConfig) == 56
    assert pdl.LaunchConfig.hStream.offset == 32
    assert pdl.LaunchConfig.attrs.offset == 40
    assert pdl.LaunchConfig.numAttrs.offset == 48


def test_config_carries_grid_block_smem_stream_and_the_attribute(rng):
    gx, gy = (int(v) for v in rng.integers(1, 1000, 2))
    smem, stream = int(rng.integers(0, 200_000)), int(rng.integers(1, 2**47))
    cfg = pdl.make_config((gx, gy), (256,), smem, stream)
    assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ) == (gx, gy, 1)
    assert (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ) == (256, 1, 1)
    assert cfg.sharedMemBytes == smem and cfg.hStream == stream and cfg.numAttrs == 1
    assert cfg.attrs[0].id == pdl.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION == 6
    assert cfg.attrs[0].value[0] == 1 and list(cfg.attrs[0].value[1:]) == [0] * 15


def test_config_carries_cluster_dims_with_or_without_pdl(rng):
    c = int(rng.integers(2, 9))
    gy = c * int(rng.integers(1, 20))
    cfg = pdl.make_config((4, gy, 3), (160,), 1000, 7, cluster=(1, c, 1))
    assert cfg.numAttrs == 2 and cfg.attrs[0].id == pdl.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert cfg.attrs[1].id == pdl.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION == 4
    assert list(cfg.attrs[1].value[:4]) == [1, c, 1, 0]
    plain = pdl.make_config((4, gy, 3), (160,), 1000, 7, cluster=(1, c, 1), programmatic=False)
    assert plain.numAttrs == 1 and plain.attrs[0].id == pdl.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    assert pdl.make_config((4,), (32,), 0, 7, programmatic=False).numAttrs == 0
    with pytest.raises(KernelError, match="does not divide"):
        pdl.make_config((4, gy + 1, 3), (160,), 0, 7, cluster=(1, c, 1))


def test_arguments_are_marshalled_as_cupy_would(rng):
    ptr = int(rng.integers(1, 2**47))
    i32 = np.int32(rng.integers(-(2**31), 2**31))
    f32 = np.float32(rng.standard_normal())
    args = (_Dev(ptr), i32, f32, checks.NULL, _Dev(ptr + 16))
    params, bufs = pdl.pack_args(args)
    assert len(bufs) == len(args)
    read = [ctypes.c_uint64, ctypes.c_int32, ctypes.c_float, ctypes.c_uint64, ctypes.c_uint64]
    got = [ctypes.cast(params[i], ctypes.POINTER(t)).contents.value for i, t in enumerate(read)]
    assert got[0] == ptr and got[1] == int(i32) and got[2] == float(f32)
    assert got[3] == 0 and got[4] == ptr + 16
    # each value's storage has the C size the kernel reads
    assert [ctypes.sizeof(b) for b in bufs] == [8, 4, 4, 8, 8]


@pytest.mark.parametrize("bad", [3, 1.5, None, "x"])
def test_a_python_scalar_or_none_is_refused_by_position(bad):
    with pytest.raises(KernelError, match="argument 1 is a"):
        pdl.pack_args((np.int32(1), bad))


@pytest.mark.parametrize(("value", "on"), [(None, True), ("1", True), ("0", False), ("off", False),
                                           ("false", False), ("yes", True)])
def test_switch(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("NANOQWEN_PDL", raising=False)
    else:
        monkeypatch.setenv("NANOQWEN_PDL", value)
    assert pdl.enabled_by_env() is on
