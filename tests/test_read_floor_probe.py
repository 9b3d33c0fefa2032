"""scripts/read_floor_probe.py on the CPU: its kernel compiles for sm_90a in every build its cases use (NVRTC needs no
GPU), and its case list follows its options (the GPU run is the script itself: docs/PERF.md, thirty-first lease)."""

from __future__ import annotations

import argparse

import pytest
from scripts_import import load_script


def _probe():
    return load_script("read_floor_probe")


def _args(**kw):
    base = dict(sizes_mb="8.53,35.0", blocks_per_sm="1,2", unroll="4,8", span_blocks="224", down=False, shape="",
                x_bulk=False)
    return argparse.Namespace(**{**base, **kw})


def test_cases_follow_the_options():
    probe = _probe()
    plain = probe.cases(_args(), sms=132)
    # sizes x (2 stride grids + 1 span grid) x unroll x launch modes, no prologue, no cap
    assert len(plain) == 2 * 3 * 2 * 3
    assert {c.blocks for c in plain if c.pattern == "stride"} == {132, 264}
    assert all(c.x_kb == 0 and c.cap == 0 for c in plain)
    shaped = probe.cases(_args(shape="8.257:288:3:7.168"), sms=132)[len(plain):]
    # with and without the prologue, with and without the release
    assert sorted((c.x_kb, c.launch) for c in shaped) == [(0.0, "pdl"), (0.0, "pdl+trig"), (7.168, "pdl"),
                                                          (7.168, "pdl+trig")]
    assert all(c[:5] == (8.257, "rows2", 288, 8, 1) and c.cap == 3 for c in shaped)
    down = probe.cases(_args(down=True), sms=132)[len(plain):]
    assert {c.cap for c in down} == {2} and {c.d for c in down} == {1, 2}
    bulk = probe.cases(_args(shape="8.257:288:3:7.168", x_bulk=True), sms=132)[len(plain) + len(shaped):]
    # every case with a prologue once more, its x by the bulk copy; none without one
    assert [c._replace(x_bulk=0) for c in bulk] == [c for c in shaped if c.x_kb > 0]
    assert all(c.x_bulk == 1 for c in bulk) and not any(c.x_bulk for c in shaped)
    with pytest.raises(SystemExit, match="at most"):  # a prologue larger than the kernel's copy holds
        probe.cases(_args(shape="8.257:288:3:50"), sms=132)


@pytest.mark.parametrize("u,d", [(4, 1), (8, 1), (8, 2), (16, 1)])
def test_kernel_compiles_for_sm90a(u, d):
    from cupy_backends.cuda.libs import nvrtc  # NVRTC (nanoqwen-kernels[cuda12]): no GPU needed

    prog = nvrtc.createProgram(_probe().SRC, "read_floor.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["-std=c++17", "--gpu-architecture=sm_90a", f"-DU={u}", f"-DD={d}"])
    except nvrtc.NVRTCError:
        pytest.fail(nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)
