"""The batch-1 L2 prefetch plan (cuda/l2_prefetch.py): the spec's grammar and the byte ranges it picks.
CPU only: the weights are stand-ins with a device pointer, shape and size, as CuPy arrays have."""

from __future__ import annotations

import numpy as np
import pytest

from nanoqwen_engine.cuda import l2_prefetch as lp
from nanoqwen_engine.cuda.weights import GpuLayer, Int4Weight


class _Ptr:
    def __init__(self, ptr):
        self.ptr = ptr


class _DevArray:
    def __init__(self, ptr, shape, itemsize):
        self.data, self.shape = _Ptr(ptr), shape
        self.nbytes = int(np.prod(shape)) * itemsize


def _layer(h=3584, i=18944, base=1 << 32):
    """A 7B-shaped layer whose tensors sit at distinct 256-byte-aligned addresses."""
    addr = [base]

    def arr(shape, itemsize):
        a = _DevArray(addr[0], shape, itemsize)
        addr[0] += -(-a.nbytes // 256) * 256
        return a

    def w(n, k):
        return Int4Weight(arr((n, k // 8), 4), arr((n, k // 128), 2))

    return GpuLayer(in_norm=arr((h,), 2), qkv=w(h + 1024, h), qkv_bias=arr((h + 1024,), 2), o=w(h, h),
                    post_norm=arr((h,), 2), gate_up=w(2 * i, h), down=w(h, i))


def test_parse_spec():
    assert lp.parse_spec("o,gu:16, down:8") == [("o", 0.0), ("gu", 16.0), ("down", 8.0)]
    assert lp.parse_spec("none") == [] and lp.parse_spec("") == []
    for bad in ("x", "gu", "o:3", "gu:-1", "down:abc"):
        with pytest.raises(ValueError):
            lp.parse_spec(bad)


def test_ranges_are_the_rows_the_kernels_read_first():
    lw, i, h = _layer(), 18944, 3584
    got = lp.layer_ranges(lw, lp.parse_spec("o,gu:16,down:4"), i)
    assert all(p % 16 == 0 and n % 16 == 0 and n > 0 for p, n in got)
    # o_proj: all of its weights and scales
    assert got[:2] == [(lw.o.qweight.data.ptr, lw.o.qweight.nbytes), (lw.o.scales.data.ptr, lw.o.scales.nbytes)]
    # gate/up: the same rows of gate and of up (whole groups of 32), 16 MB in all at most
    gw, gs = lw.gate_up.qweight, lw.gate_up.scales
    rows = got[2][1] // (h // 2)
    assert rows % 32 == 0 and 0 < rows < i
    assert got[2:6] == [(gw.data.ptr, rows * h // 2), (gs.data.ptr, rows * h // 64),
                        (gw.data.ptr + i * h // 2, rows * h // 2), (gs.data.ptr + i * h // 64, rows * h // 64)]
    assert 15 << 20 < sum(n for _, n in got[2:6]) <= 16 << 20
    # down: its first rows
    assert got[6][0] == lw.down.qweight.data.ptr and got[7][0] == lw.down.scales.data.ptr
    assert 3 << 20 < got[6][1] + got[7][1] <= 4 << 20


def test_plan_is_off_by_default_and_on_host_arrays(monkeypatch):
    monkeypatch.delenv("NANOQWEN_DECODE_PREFETCH", raising=False)
    layers = [_layer(), _layer(base=1 << 34)]
    assert lp.plan(None, layers, 18944) == [None, None] or lp.DEFAULT_SPEC != "none"
    host = GpuLayer(**{**layers[0].__dict__, "o": Int4Weight(np.zeros((4, 4)), np.zeros((4, 1)))})
    assert lp.plan(None, [host], 18944, spec="o") == [None]  # numpy stand-ins: no device pointers
