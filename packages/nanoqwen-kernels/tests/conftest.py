"""Shared fixtures: a private kernel cache per test session, and the GPU gate."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # refs.py beside the tests


@pytest.fixture(autouse=True)
def _private_kernel_cache(tmp_path_factory, monkeypatch):
    # one cache per session (compiles are the slow part of the CPU tests); tests that need an empty
    # cache point NANOQWEN_KERNEL_CACHE elsewhere themselves
    monkeypatch.setenv("NANOQWEN_KERNEL_CACHE", str(tmp_path_factory.getbasetemp() / "kcache"))


@pytest.fixture(scope="session")
def gpu():
    """CuPy, once a usable Hopper GPU is known to be present; else the test skips with the reason."""
    from nanoqwen_kernels import gpu_status

    ok, reason = gpu_status()
    if not ok:
        pytest.skip(f"no usable GPU: {reason}")
    import cupy

    return cupy


def pytest_addoption(parser):
    try:
        parser.addoption("--seed", type=int, default=None,
                         help="seed of the `rng` fixture (default: a fresh one per test, printed)")
    except ValueError:  # another conftest of the same run registered it already
        pass


@pytest.fixture
def rng(request):
    """A numpy Generator from a fresh seed, printed at setup (a failing test's report shows it under
    "Captured stdout setup"); `pytest --seed N` replays one."""
    import numpy as np

    given = request.config.getoption("--seed", default=None)
    seed = int(given) if given is not None else int(np.random.SeedSequence().entropy % 2**32)
    print(f"rng seed {seed} (replay: pytest --seed {seed})")
    return np.random.default_rng(seed)
