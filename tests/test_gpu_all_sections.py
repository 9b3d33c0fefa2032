"""scripts/gpu_all.sh runs the kernels' GPU suite in two halves (kernels_decode, kernels_prefill), each a file
list of its own so that each fits one device call: every kernels test file with a GPU test must be in exactly
one of them, or a new file's tests would never run on the GPU."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = ROOT / "packages" / "nanoqwen-kernels" / "tests"


def _half(script: str, name: str) -> list[str]:
    m = re.search(rf"run {name} \d+ \$PYTEST (.*?)\n(?!\s)", script, re.S)
    assert m, f"gpu_all.sh has no `run {name}` line"
    return re.findall(r"\$KT/(test_\w+\.py)", m.group(1))


def test_the_kernels_halves_cover_every_gpu_test_file_once():
    script = (ROOT / "scripts" / "gpu_all.sh").read_text()
    decode, prefill = _half(script, "kernels_decode"), _half(script, "kernels_prefill")
    assert decode and prefill
    listed = decode + prefill
    assert len(listed) == len(set(listed)), f"a file in both halves: {sorted(listed)}"
    with_gpu = sorted(p.name for p in KERNEL_TESTS.glob("test_*.py") if "mark.gpu" in p.read_text())
    assert sorted(listed) == with_gpu
