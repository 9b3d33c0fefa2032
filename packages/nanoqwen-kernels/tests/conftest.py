"""Shared fixtures: every test compiles into its own kernel cache so no run sees another's cubins."""

import pytest


@pytest.fixture(autouse=True)
def _private_kernel_cache(tmp_path_factory, monkeypatch):
    # one cache per session (compiles are the slow part of the CPU tests); tests that need an empty
    # cache point NANOQWEN_KERNEL_CACHE elsewhere themselves
    monkeypatch.setenv("NANOQWEN_KERNEL_CACHE", str(tmp_path_factory.getbasetemp() / "kcache"))
