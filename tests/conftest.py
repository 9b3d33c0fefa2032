"""Cross-package fixtures: synthetic models written once per session, and the GPU gate.

The ladder's models (written with nanoqwen_format.synthetic, so the repo needs no checkpoint):
    tiny    hidden 256, 4 layers, 2 heads / 1 KV head, the real 152064 vocab (real prompts tokenize);
            also the CLI tests' `tiny_model`
    7b      the Qwen2.5-Coder-7B config (28 layers, hidden 3584): ~5.5 GB, written only by GPU tests
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from nanoqwen_engine.testing import pytest_addoption, pytest_runtest_makereport, rng, seed  # noqa: F401
from nanoqwen_kernels.testing import gpu  # noqa: F401  (CuPy, or a skip naming why there is no GPU)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ladder/ helpers


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA Hopper GPU (sm_90) and CuPy")


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory):
    # NANOQWEN_LADDER_MODELS lets scripts/gpu_all.sh write the 7B file once and share it across runs
    d = os.environ.get("NANOQWEN_LADDER_MODELS")
    if d:
        Path(d).mkdir(parents=True, exist_ok=True)
        return Path(d)
    return tmp_path_factory.mktemp("ladder_models")


@pytest.fixture(scope="session")
def ladder_tiny_path(models_dir):
    from ladder.models import tiny_model

    return tiny_model(models_dir)


@pytest.fixture(scope="session")
def tiny_model(ladder_tiny_path):
    """The CLI tests' model: the ladder's tiny one (written once per session, shared)."""
    return ladder_tiny_path


@pytest.fixture
def env(tmp_path):
    """The environment of a CLI subprocess (nanoqwen_cli.testing): an empty model cache and an empty, offline
    Hugging Face home, so nothing reaches the network; no default model or debug flag from outside."""
    e = dict(os.environ)
    e.update(
        NANOQWEN_CACHE=str(tmp_path / "cache"),
        HF_HOME=str(tmp_path / "hf"),
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="0",  # the CLI must flush its own stream writes
    )
    for name in ("NANOQWEN_MODEL", "NANOQWEN_DEBUG"):
        e.pop(name, None)
    return e


@pytest.fixture(scope="session")
def ladder_7b_path(models_dir, request):
    """NANOQWEN_LADDER_7B names the file (scripts/gpu_all.sh shares the bench's); written if missing."""
    request.getfixturevalue("gpu")  # no GPU: skip before writing 5.5 GB
    from ladder.models import qwen7b_model

    return qwen7b_model(models_dir, os.environ.get("NANOQWEN_LADDER_7B"))
