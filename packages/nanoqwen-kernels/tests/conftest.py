"""Shared fixtures: a private kernel cache per test session, the GPU gate, and the seeded random numbers.

Every test that draws random numbers takes the `rng` fixture: a numpy Generator seeded from a fresh
seed per test (or from `--seed N`, to replay a failure). A failing test's report names its seed.
"""

import os
import secrets
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # refs.py beside the tests


SEED = pytest.StashKey[int]()


def pytest_addoption(parser):
    parser.addoption(
        "--seed", type=int, default=None, help="seed of the kernels tests' random numbers (replays a failure)"
    )


@pytest.fixture
def rng(request):
    seed = request.config.getoption("--seed")
    if seed is None:
        seed = secrets.randbits(32)
    request.node.stash[SEED] = seed
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = item.stash.get(SEED, None)
    if seed is not None and report.failed:
        report.sections.append(("random seed", f"replay with --seed {seed}"))


@pytest.fixture(autouse=True)
def _private_kernel_cache(tmp_path_factory, monkeypatch):
    # one cache per session (compiles are the slow part of the CPU tests); tests that need an empty
    # cache point NANOQWEN_KERNEL_CACHE elsewhere themselves. $NANOQWEN_TEST_KERNEL_CACHE names a cache
    # filled beforehand (the GPU runs carry cubins compiled on the CPU machine with the same NVRTC).
    pre = os.environ.get("NANOQWEN_TEST_KERNEL_CACHE")
    monkeypatch.setenv("NANOQWEN_KERNEL_CACHE", pre or str(tmp_path_factory.getbasetemp() / "kcache"))


@pytest.fixture(scope="session")
def gpu():
    """CuPy, once a usable Hopper GPU is known to be present; else the test skips with the reason."""
    from nanoqwen_kernels import gpu_status

    ok, reason = gpu_status()
    if not ok:
        pytest.skip(f"no usable GPU: {reason}")
    import cupy

    return cupy
