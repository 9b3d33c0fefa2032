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


@pytest.fixture
def launches(monkeypatch):
    """The launches a launcher makes, as (function name, grid, args), with nothing compiled or run (each
    one's arguments packed as the PDL launch would: pdl.pack_args refuses what it cannot pass, and a
    cluster shape checked against its grid as make_config does): the launch helpers of
    nanoqwen_kernels.checks replaced (132 SMs; CuPy stood in for by fakes.fake_cupy). `.clusters` holds
    each launch's cluster dims (None: no cluster)."""
    from fakes import fake_cupy
    from nanoqwen_kernels import checks, pdl

    class Calls(list):
        clusters: list
        attributes: list

    calls = Calls()
    calls.clusters = []

    def record(fn, grid, block, args, shared_mem=0, cluster=None):
        pdl.pack_args(args)  # every launch's arguments must be marshallable for cuLaunchKernelEx
        if cluster is not None:
            pdl.make_config(grid if isinstance(grid, tuple) else (grid,), block if isinstance(block, tuple)
                            else (block,), shared_mem, 0, cluster)
        calls.append((fn, grid, args))
        calls.clusters.append(cluster)

    monkeypatch.setattr(checks, "launch", record)
    monkeypatch.setattr(
        checks, "even_grid", lambda fn, units, threads, shared_mem=0, copies=1: min(units, 132 * 4 // copies)
    )
    monkeypatch.setattr(checks, "sm_count", lambda device_id=None: 132)
    calls.attributes = []
    monkeypatch.setattr(checks, "set_function_attribute", lambda fn, attr, value: calls.attributes.append(
        (fn, attr, value)))
    # 2 blocks an SM, clusters anywhere: what an H200 holds of decode attention's launch
    monkeypatch.setattr(checks, "max_active_clusters",
                        lambda fn, grid, block, shared_mem, cluster: 132 * 2 // (cluster[0] * cluster[1] * cluster[2]))
    monkeypatch.setattr(checks, "cupy_module", fake_cupy)
    return calls
