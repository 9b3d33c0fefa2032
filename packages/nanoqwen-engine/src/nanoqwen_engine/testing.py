"""Test support shared by the engine's, the CLI's and the repository's integration tests (imported by their
conftest.py files; needs pytest): one seeded random generator per test.

Every test that draws random numbers takes the `rng` fixture: a numpy Generator seeded from a fresh seed
per test, or from `pytest --seed N` to replay a failure; a failing test's report names its seed. The
fixtures are the kernels' (nanoqwen_kernels.testing), one copy for every package above them.
"""

from __future__ import annotations

from nanoqwen_kernels.testing import pytest_addoption, pytest_runtest_makereport, rng, seed

__all__ = ["pytest_addoption", "pytest_runtest_makereport", "rng", "seed"]
