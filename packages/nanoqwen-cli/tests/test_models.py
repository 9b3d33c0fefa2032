"""`nanoqwen-cli models`, `pull`, `rm` on local Hugging Face folders (the hub path runs as a subprocess
against a Hugging Face cache laid out on disk: test_models_hub.py)."""

from __future__ import annotations

import json
import os

from nanoqwen_format.synthetic import tiny_config, write_hf_checkpoint

SMALL = dict(hidden_size=128, num_attention_heads=1, intermediate_size=256, vocab_size=2048,
             tie_word_embeddings=True, num_hidden_layers=1)  # fmt: skip


def test_empty_cache_says_how_to_get_a_model(invoke):
    result = invoke(["models"])
    assert result.exit_code == 0 and result.stdout == ""
    assert "nanoqwen-cli pull" in result.stderr
    assert json.loads(invoke(["models", "--json"]).stdout) == []


def test_pull_lists_runs_by_name_and_removes(invoke, tmp_path, rng):
    folder = write_hf_checkpoint(tmp_path / "my-coder", tiny_config(**SMALL), seed=int(rng.integers(1 << 30)))
    pulled = invoke(["pull", folder, "--quiet"])
    assert pulled.exit_code == 0, pulled.output
    cache = os.environ["NANOQWEN_CACHE"]
    assert (
        pulled.stdout.startswith("converted my-coder (")
        and os.path.join(cache, "my-coder.nanoqwen") in pulled.stdout
    )
    again = invoke(["pull", folder, "--quiet"])
    assert again.exit_code == 0 and again.stdout.startswith("cached my-coder"), (
        "unchanged: not converted again"
    )

    listed = invoke(["models"])
    assert listed.exit_code == 0, listed.output
    header, row = listed.stdout.splitlines()
    assert header.split() == ["NAME", "SIZE", "SOURCE", "QUANTIZATION", "LAST", "USED"]
    assert row.startswith("my-coder ") and str(folder) in row and "int4 g128" in row and "MB" in row
    assert "cache: " in listed.stderr and "Hugging Face downloads: " in listed.stderr

    run = invoke(
        ["run", "--model", "my-coder", "--device", "cpu", "--raw", "-t", 0, "-n", 3, "--json", "x = "]
    )
    assert run.exit_code == 0, run.output
    assert json.loads(run.stdout)["model_path"] == os.path.join(cache, "my-coder.nanoqwen")
    (record,) = json.loads(invoke(["models", "--json"]).stdout)
    assert record["name"] == "my-coder" and record["kind"] == "folder" and record["source"] == str(folder)
    assert record["last_used"] >= record["converted_at"] and record["size_bytes"] > 0

    removed = invoke(["rm", "my-coder"])
    assert removed.exit_code == 0 and removed.stdout.startswith("removed my-coder")
    assert json.loads(invoke(["models", "--json"]).stdout) == []
    missing = invoke(["rm", "my-coder"])
    assert missing.exit_code == 1 and missing.stderr.startswith("error: no model named 'my-coder'")


def test_pull_of_a_file_is_one_error(invoke, tiny_model):
    result = invoke(["pull", tiny_model])
    assert (
        result.exit_code == 1
        and result.stderr.strip() == f"error: {tiny_model} is a .nanoqwen file already; nothing to pull"
    )


def test_models_lists_a_damaged_file_without_failing(invoke):
    cache = os.environ["NANOQWEN_CACHE"]
    os.makedirs(cache)
    with open(os.path.join(cache, "broken.nanoqwen"), "wb") as f:
        f.write(b"NOTNANOQ" + bytes(100))
    result = invoke(["models"])
    assert result.exit_code == 0, result.output
    assert "broken" in result.stdout and "unreadable" in result.stdout
