"""Test support shared by the engine's tests and the repository's integration tests (imported by their
conftest.py files; needs pytest): one seeded random generator per test.

Every test that draws random numbers takes the `rng` fixture: a numpy Generator seeded from a fresh
seed, printed at setup so a failing test's report shows it ("Captured stdout setup"), and replayed with
`pytest --seed N`.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest


def pytest_addoption(parser) -> None:
    try:
        parser.addoption("--seed", type=int, default=None,
                         help="seed of the `rng` fixture (default: a fresh one per test, printed)")
    except ValueError:  # both conftests loaded in one run: the option exists already
        pass


@pytest.fixture
def seed(request) -> int:
    given = request.config.getoption("--seed", default=None)
    s = int(given) if given is not None else secrets.randbits(32)
    print(f"rng seed {s} (replay: pytest --seed {s})")
    return s


@pytest.fixture
def rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)
