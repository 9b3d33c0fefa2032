"""Shared fixtures: a private kernel cache per test session, the GPU gate, and the seeded random numbers.

Every test that draws random numbers takes the `rng` fixture: a numpy Generator seeded from a fresh
seed per test (or from `--seed N`, to replay a failure). A failing test's report names its seed.
`gpu`, `seed`, `rng` and the report hook live in nanoqwen_kernels.testing (the root tests use them too).
"""

import os
import sys
from pathlib import Path

import pytest
from nanoqwen_kernels.testing import gpu, pytest_addoption, pytest_runtest_makereport, rng, seed  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parent))  # refs.py beside the tests


@pytest.fixture(autouse=True)
def _private_kernel_cache(tmp_path_factory, monkeypatch):
    # one cache per session (compiles are the slow part of the CPU tests); tests that need an empty
    # cache point NANOQWEN_KERNEL_CACHE elsewhere themselves. $NANOQWEN_TEST_KERNEL_CACHE names a cache
    # filled beforehand (the GPU runs carry cubins compiled on the CPU machine with the same NVRTC).
    pre = os.environ.get("NANOQWEN_TEST_KERNEL_CACHE")
    monkeypatch.setenv("NANOQWEN_KERNEL_CACHE", pre or str(tmp_path_factory.getbasetemp() / "kcache"))
