"""Shared fixtures: tiny synthetic models (written once per session) and the real Qwen2.5 tokenizer."""

from __future__ import annotations

import pytest
from nanoqwen_engine import Engine
from nanoqwen_engine.config import ModelConfig
from nanoqwen_engine.testing import pytest_addoption, pytest_runtest_makereport, rng, seed  # noqa: F401
from nanoqwen_engine.tokenizer import Tokenizer
from nanoqwen_format import open_model, tiny_config, write_synthetic
from nanoqwen_format.synthetic import shipped_tokenizer


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """hidden 256, 2 layers, 2 heads / 1 KV head (GQA group 2), the real vocab 152064, untied lm_head."""
    return write_synthetic(tmp_path_factory.mktemp("models") / "tiny.nanoqwen", tiny_config(), seed=11)


@pytest.fixture(scope="session")
def tied_path(tmp_path_factory):
    """A second shape: tied embeddings, 4 heads / 2 KV heads, 3 layers, a small vocab (fast lm_head)."""
    cfg = tiny_config(tie_word_embeddings=True, hidden_size=512, intermediate_size=384, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=3, vocab_size=4096, rope_theta=10000.0)
    return write_synthetic(tmp_path_factory.mktemp("models") / "tied.nanoqwen", cfg, seed=12)


@pytest.fixture(scope="session", params=["tiny", "tied"])
def model_path(request, tiny_path, tied_path):
    return {"tiny": tiny_path, "tied": tied_path}[request.param]


@pytest.fixture(scope="session")
def tiny_engine(tiny_path):
    """A CPU engine with a 96-token context and a pool of 12 pages (2 full sequences)."""
    return Engine.load(tiny_path, device="cpu", max_context=96, progress=False)


@pytest.fixture(scope="session")
def tokenizer():
    """The Qwen2.5-Coder tokenizer every synthetic model here embeds (no model file needed)."""
    tok_json, tok_config, _ = shipped_tokenizer()
    return Tokenizer(tok_json, tok_config)


@pytest.fixture(scope="session")
def open_file():
    """open_model(path) -> (file, ModelConfig), kept open for the session."""
    opened = {}

    def get(path):
        if path not in opened:
            nq = open_model(path)
            opened[path] = (nq, ModelConfig.from_hf(nq.config, nq.generation_config))
        return opened[path]

    return get


@pytest.fixture(params=["host", pytest.param("gpu", marks=pytest.mark.gpu)])
def kind(request):
    """"host": the CudaBackend on numpy stand-ins; "gpu": on the GPU (marked gpu, skipped without one)."""
    if request.param == "gpu":
        from nanoqwen_kernels import gpu_status

        ok, reason = gpu_status()
        if not ok:
            pytest.skip(f"no usable GPU: {reason}")
    return request.param
