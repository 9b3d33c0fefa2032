"""resolve_model: .nanoqwen paths pass through; an HF folder is converted once into $NANOQWEN_CACHE."""

from __future__ import annotations

import os

import numpy as np
import pytest
from nanoqwen_engine import Engine, ModelNotFoundError, SamplingParams
from nanoqwen_engine.model_source import cache_dir, resolve_model
from nanoqwen_format import tiny_config
from nanoqwen_format.synthetic import write_hf_checkpoint


def test_nanoqwen_file_passes_through(tiny_path):
    assert resolve_model(tiny_path) == tiny_path


def test_hf_folder_is_converted_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"
    cfg = tiny_config(hidden_size=128, num_attention_heads=1, intermediate_size=256, vocab_size=2048,
                      tie_word_embeddings=True, num_hidden_layers=1)
    src = write_hf_checkpoint(tmp_path / "hf", cfg, seed=3)
    out = resolve_model(src, progress=False)
    assert out.parent == tmp_path / "cache" and out.suffix == ".nanoqwen"
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [out.name]  # no temporary left behind
    mtime = out.stat().st_mtime_ns
    assert resolve_model(src, progress=False) == out and out.stat().st_mtime_ns == mtime  # reused
    engine = Engine.load(src, device="cpu", max_context=32, progress=False)
    assert engine.path == out and engine.config.tie_word_embeddings
    c = engine.complete("ab", SamplingParams(temperature=0, max_tokens=4))
    assert len(c.token_ids) == 4 and np.all(np.asarray(c.token_ids) < 2048)
    # A changed checkpoint is converted again under a new key.
    os.utime(src / "config.json", ns=(mtime + 10**9, mtime + 10**9))
    assert resolve_model(src, progress=False) != out


def test_unresolvable_sources(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(tmp_path)
    with pytest.raises(ModelNotFoundError, match="no such"):
        resolve_model(tmp_path / "nope" / "x.nanoqwen")


def test_hub_id_download_failure_is_model_not_found(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    def offline(repo_id, **kw):
        calls.append((repo_id, kw.get("allow_patterns")))
        raise OSError("We couldn't connect to 'https://huggingface.co'\nsecond line")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.chdir(tmp_path)  # so "someone/some-model" is not a relative path that exists
    with pytest.raises(ModelNotFoundError, match="cannot download 'someone/some-model'.*couldn't connect"):
        resolve_model("someone/some-model", progress=False)
    assert calls == [("someone/some-model", ["*.json", "*.safetensors"])]


def test_hub_id_is_downloaded_then_converted(tmp_path, monkeypatch):
    import huggingface_hub

    cfg = tiny_config(hidden_size=128, num_attention_heads=1, intermediate_size=256, vocab_size=2048,
                      tie_word_embeddings=True, num_hidden_layers=1)
    snapshot = write_hf_checkpoint(tmp_path / "snapshot", cfg, seed=4)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: str(snapshot))
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    out = resolve_model("someone/some-model", progress=False)
    assert out.parent == tmp_path / "cache" and out.name.startswith("someone--some-model-")
