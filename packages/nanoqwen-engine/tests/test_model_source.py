"""The model cache: .nanoqwen paths pass through; an HF folder or hub id is converted once into
$NANOQWEN_CACHE under a readable name; cached models are listed, pulled again and removed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from nanoqwen_engine import Engine, ModelNotFoundError, SamplingParams
from nanoqwen_engine import model_source as ms
from nanoqwen_engine.model_source import cache_dir, resolve_model
from nanoqwen_format import tiny_config
from nanoqwen_format.synthetic import write_hf_checkpoint

SMALL = dict(hidden_size=128, num_attention_heads=1, intermediate_size=256, vocab_size=2048,
             tie_word_embeddings=True, num_hidden_layers=1)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # so "someone/some-model" is not a relative path that exists
    return tmp_path / "cache"


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """huggingface_hub with one repo, someone/some-model, whose newest revision the test sets; every
    snapshot_download call is recorded and answered with that revision's folder."""
    import huggingface_hub

    hub = {"revision": "a" * 40, "calls": []}

    def snapshot_download(repo_id, revision=None, **kw):
        rev = revision or hub["revision"]
        hub["calls"].append((repo_id, revision))
        folder = tmp_path / "hf" / f"models--{repo_id.replace('/', '--')}" / "snapshots" / rev
        if not folder.exists():
            write_hf_checkpoint(folder, tiny_config(**SMALL), seed=len(hub["calls"]))
        return str(folder)

    class Api:
        def model_info(self, repo_id):
            if hub.get("offline"):
                raise OSError("offline")
            return type("Info", (), {"sha": hub["revision"]})()

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    return hub


def test_nanoqwen_file_passes_through(tiny_path):
    assert resolve_model(tiny_path) == tiny_path


def test_hf_folder_is_converted_once_into_the_cache(tmp_path, cache):
    assert cache_dir() == cache
    src = write_hf_checkpoint(tmp_path / "my-qwen", tiny_config(**SMALL), seed=3)
    out = resolve_model(src, progress=False)
    assert out == cache / "my-qwen.nanoqwen", "a folder's cache name is the folder's name"
    assert sorted(p.name for p in cache.iterdir()) == ["my-qwen.json", "my-qwen.nanoqwen"], "no temporary left"
    meta = json.loads((cache / "my-qwen.json").read_text())
    assert meta["source"] == str(src.resolve()) and meta["kind"] == "folder"
    mtime = out.stat().st_mtime_ns
    assert resolve_model(src, progress=False) == out and out.stat().st_mtime_ns == mtime  # reused
    engine = Engine.load(src, device="cpu", max_context=32, progress=False)
    assert engine.path == out and engine.config.tie_word_embeddings
    c = engine.complete("ab", SamplingParams(temperature=0, max_tokens=4))
    assert len(c.token_ids) == 4 and np.all(np.asarray(c.token_ids) < 2048)
    # A changed checkpoint is converted again, in place.
    os.utime(src / "config.json", ns=(mtime + 10**9, mtime + 10**9))
    assert resolve_model(src, progress=False) == out and out.stat().st_mtime_ns != mtime


def test_two_folders_with_one_name_get_two_entries(tmp_path, cache):
    a = write_hf_checkpoint(tmp_path / "a" / "qwen", tiny_config(**SMALL), seed=3)
    b = write_hf_checkpoint(tmp_path / "b" / "qwen", tiny_config(**SMALL), seed=4)
    pa, pb = resolve_model(a, progress=False), resolve_model(b, progress=False)
    assert pa.name == "qwen.nanoqwen" and pb.name.startswith("qwen-") and pa != pb
    assert resolve_model(a, progress=False) == pa and resolve_model(b, progress=False) == pb


def test_unresolvable_sources(tmp_path, cache):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(tmp_path)
    with pytest.raises(ModelNotFoundError, match="no such"):
        resolve_model(tmp_path / "nope" / "x.nanoqwen")
    with pytest.raises(ModelNotFoundError, match="no such file"):
        resolve_model("models/x.nanoqwen")  # a missing relative file, not a hub id to download


def test_hub_id_download_failure_is_model_not_found(cache, monkeypatch):
    import huggingface_hub

    calls = []

    def offline(repo_id, **kw):
        calls.append((repo_id, kw.get("allow_patterns")))
        raise OSError("We couldn't connect to 'https://huggingface.co'\nsecond line")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelNotFoundError, match="cannot download 'someone/some-model'.*couldn't connect"):
        resolve_model("someone/some-model", progress=False)
    assert calls == [("someone/some-model", ["*.json", "*.safetensors"])]


def test_hub_id_is_downloaded_converted_then_used_offline(cache, fake_hub):
    out = resolve_model("someone/some-model", progress=False)
    assert out == cache / "someone--some-model.nanoqwen"
    meta = ms.read_meta(out)
    assert meta["source"] == "someone/some-model" and meta["kind"] == "hub" and meta["revision"] == "a" * 40
    assert Path(meta["download_dir"]).name == "models--someone--some-model"
    # Cached: neither the hub id nor the cache name asks the network again.
    assert resolve_model("someone/some-model", progress=False) == out
    assert resolve_model("someone--some-model", progress=False) == out
    assert resolve_model("someone--some-model.nanoqwen", progress=False) == out
    assert len(fake_hub["calls"]) == 1


def test_pull_converts_again_only_for_a_new_revision(cache, fake_hub):
    first = ms.pull_model("someone/some-model", progress=False)
    assert first.converted and first.meta["revision"] == "a" * 40
    again = ms.pull_model("someone/some-model", progress=False)
    assert not again.converted and "up to date" in again.note
    fake_hub["offline"] = True
    offline = ms.pull_model("someone--some-model", progress=False)  # by cache name
    assert not offline.converted and "cannot ask the hub" in offline.note
    fake_hub["offline"] = False
    fake_hub["revision"] = "b" * 40
    newer = ms.pull_model("someone/some-model", progress=False)
    assert newer.converted and newer.path == first.path and newer.meta["revision"] == "b" * 40
    assert fake_hub["calls"][-1] == ("someone/some-model", "b" * 40)
    forced = ms.pull_model("someone/some-model", progress=False, force=True)
    assert forced.converted


def test_pull_refuses_a_file(tiny_path, cache):
    with pytest.raises(ModelNotFoundError, match="nothing to pull"):
        ms.pull_model(str(tiny_path))


def test_list_and_remove(tmp_path, cache, fake_hub, tiny_path):
    from nanoqwen_format.integrity import record_path, verify_once

    hub = resolve_model("someone/some-model", progress=False)
    folder = resolve_model(write_hf_checkpoint(tmp_path / "local", tiny_config(**SMALL), seed=5), progress=False)
    (cache / "broken.nanoqwen").write_bytes(b"not a model")
    verify_once(hub, ms.verified_dir(cache))
    listed = {m.name: m for m in ms.list_models()}
    assert set(listed) == {"someone--some-model", "local", "broken"}
    h = listed["someone--some-model"]
    assert h.kind == "hub" and h.source == "someone/some-model" and h.quantization == "int4 g128"
    assert h.size == hub.stat().st_size and h.last_used is not None and h.error is None
    assert listed["local"].kind == "folder" and listed["local"].path == folder
    assert listed["broken"].error and listed["broken"].quantization is None

    gone = ms.remove_model("someone/some-model")
    assert gone.path == hub and not hub.exists() and not ms.meta_path(hub).exists()
    assert not record_path(hub, ms.verified_dir(cache)).exists(), "the CRC record goes with the file"
    ms.remove_model("local.nanoqwen")
    assert [m.name for m in ms.list_models()] == ["broken"]
    with pytest.raises(ModelNotFoundError, match="models"):
        ms.remove_model("local")


def test_drop_download_frees_the_hub_copy(tmp_path, cache, monkeypatch):
    """A Hugging Face cache laid out as huggingface_hub writes it (blobs, snapshot links, refs)."""
    hf = tmp_path / "hf-home" / "hub"
    repo = hf / "models--someone--some-model"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    snap = repo / "snapshots" / ("c" * 40)
    snap.mkdir(parents=True)
    (repo / "refs" / "main").write_text("c" * 40)
    payload = bytes(range(256)) * 16
    (repo / "blobs" / "deadbeef").write_bytes(payload)
    (snap / "model.safetensors").symlink_to(repo / "blobs" / "deadbeef")
    assert ms.download_size(repo) == 4096 + 40, "the blob and the ref; the snapshot link is free"
    monkeypatch.setattr(ms, "hf_hub_cache", lambda: hf)
    assert ms.drop_download("someone/some-model") == 4096
    assert not repo.exists()
    assert ms.drop_download("someone/some-model") == 0
