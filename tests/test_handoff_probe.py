"""scripts/handoff_probe.py on the CPU: its two kernels compile for sm_90a (NVRTC needs no GPU), and the one-kernel
build keeps to the registers that hold PERSISTENT_PER_SM blocks of 256 threads an SM, which its grid barrier needs
(every block resident at once; the GPU run is the script itself: docs/PERF.md, thirty-second lease)."""

from __future__ import annotations

import re

import pytest
from scripts_import import load_script

REGISTERS_PER_SM = 65536  # sm_90


def _probe():
    return load_script("handoff_probe")


def _ptxas_report(src: str, u: int) -> dict[str, tuple[int, int]]:
    """{function: (registers, spill store bytes)} from ptxas's report of an sm_90a build."""
    from cupy_backends.cuda.libs import nvrtc  # NVRTC (nanoqwen-kernels[cuda12]): no GPU needed

    prog = nvrtc.createProgram(src, "handoff.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["-std=c++17", "--gpu-architecture=sm_90a", f"-DU={u}", "--ptxas-options=-v"])
        log = nvrtc.getProgramLog(prog)
    except nvrtc.NVRTCError:
        pytest.fail(nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)
    out = {}
    for fn, body in re.findall(r"Compiling entry function '(\w+)'.*?\n(.*?)Compile time", log, re.S):
        regs = int(re.search(r"Used (\d+) registers", body).group(1))
        spills = int(re.search(r"(\d+) bytes spill stores", body).group(1))
        out[fn] = (regs, spills)
    return out


def test_kernels_compile_and_the_persistent_grid_fits():
    probe = _probe()
    report = _ptxas_report(probe.SRC, probe.U)
    assert set(report) == {"one", "two"}
    regs, spills = report["two"]
    assert spills == 0
    assert regs * 256 * probe.PERSISTENT_PER_SM <= REGISTERS_PER_SM, f"two(): {regs} registers a thread"
