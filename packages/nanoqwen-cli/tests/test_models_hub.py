"""A hub model end to end, as real subprocesses, offline: the Hugging Face cache is laid out on disk as
huggingface_hub writes it (refs/main -> snapshots/<commit>/file -> blobs/...), so snapshot_download
finds it with HF_HUB_OFFLINE=1 and nothing reaches the network."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from nanoqwen_cli.testing import cli
from nanoqwen_format.synthetic import tiny_config, write_hf_checkpoint

HUB_ID = "someone/tiny-coder"


@pytest.fixture
def hub_env(tmp_path, rng):
    """$HF_HOME holding HUB_ID at one commit, offline; an empty $NANOQWEN_CACHE."""
    config = tiny_config(hidden_size=128, num_attention_heads=1, intermediate_size=256, vocab_size=2048,
                         tie_word_embeddings=True, num_hidden_layers=1)  # fmt: skip
    src = write_hf_checkpoint(tmp_path / "checkpoint", config, seed=int(rng.integers(1 << 30)))
    repo = tmp_path / "hf" / "hub" / f"models--{HUB_ID.replace('/', '--')}"
    commit = f"{int(rng.integers(1 << 62)):040x}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    snapshot.mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    for i, f in enumerate(sorted(src.iterdir())):
        blob = repo / "blobs" / f"{i:064x}"
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    env = dict(os.environ)
    env.update(NANOQWEN_CACHE=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    for name in ("NANOQWEN_MODEL", "NANOQWEN_DEBUG", "HF_HUB_CACHE"):
        env.pop(name, None)
    return env, repo, commit


def test_hub_model_run_list_pull_drop_rm(hub_env, tmp_path):
    env, repo, commit = hub_env
    run = ["run", "--model", HUB_ID, "--device", "cpu", "--raw", "-t", 0, "-n", 3]
    first = cli([*run, "x ="], env)
    assert first.returncode == 0, first.stderr
    cached = tmp_path / "cache" / "someone--tiny-coder.nanoqwen"
    assert cached.is_file(), "the hub id's cache name is readable"
    assert f"the download stays in the Hugging Face cache: {repo}" in first.stderr
    assert f"nanoqwen-cli pull --drop-download {HUB_ID}" in first.stderr

    (record,) = json.loads(cli(["models", "--json"], env).stdout)
    assert record["name"] == "someone--tiny-coder" and record["kind"] == "hub" and record["source"] == HUB_ID

    again = cli(["pull", HUB_ID], env)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("cached someone--tiny-coder")
    assert "kept the cached revision: cannot ask the hub" in again.stderr, "offline: the cached one stays"

    dropped = cli(["pull", "someone--tiny-coder", "--drop-download"], env)  # by its cache name
    assert dropped.returncode == 0, dropped.stderr
    assert f"dropped the Hugging Face download of {HUB_ID}" in dropped.stderr and not repo.exists()

    later = cli([*run, "x ="], env)
    assert later.returncode == 0, later.stderr
    assert later.stdout == first.stdout, "the cached model runs without its download"
    assert "download" not in later.stderr

    removed = cli(["rm", HUB_ID], env)
    assert removed.returncode == 0 and removed.stdout.startswith("removed someone--tiny-coder")
    assert not cached.exists() and json.loads(cli(["models", "--json"], env).stdout) == []
    gone = cli([*run, "x ="], env)
    assert gone.returncode == 1 and "Traceback" not in gone.stderr
    assert gone.stderr.strip().splitlines()[-1].startswith(f"error: cannot download '{HUB_ID}'")
