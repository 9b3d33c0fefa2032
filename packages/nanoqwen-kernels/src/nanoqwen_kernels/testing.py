"""pytest fixtures shared by the kernels' tests and the repository's GPU tests (imported by their
conftest.py files; needs pytest, which the package itself does not).

    gpu     CuPy, once a usable Hopper GPU is known to be present; else the test skips with the reason
    seed    this test's seed: `--seed N` if given (to replay a failure), else a fresh one
    rng     numpy Generator seeded with `seed`

A failing test that drew a seed gets a "random seed" section in its report naming it.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from .gpu import gpu_status

_SEED = pytest.StashKey[int]()


def pytest_addoption(parser) -> None:
    try:
        parser.addoption("--seed", type=int, default=None,
                         help="seed of the tests' random numbers (default: a fresh one per test; replays a failure)")
    except ValueError:  # another conftest of the same run added it already, with the same meaning
        pass


@pytest.fixture
def seed(request) -> int:
    given = request.config.getoption("--seed", default=None)
    s = int(given) if given is not None else secrets.randbits(32)
    request.node.stash[_SEED] = s
    return s


@pytest.fixture
def rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    s = item.stash.get(_SEED, None)
    if s is not None and report.failed:
        report.sections.append(("random seed", f"replay with: pytest --seed {s} {item.nodeid}"))


@pytest.fixture(scope="session")
def gpu():
    ok, reason = gpu_status()
    if not ok:
        pytest.skip(f"no usable GPU: {reason}")
    import cupy

    return cupy
