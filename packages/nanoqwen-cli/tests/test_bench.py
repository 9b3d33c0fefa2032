"""`nanoqwen-cli bench` on the CPU reference with a synthetic tiny model, small settings."""

from __future__ import annotations

import json
import os

from nanoqwen_cli import bandwidth
from nanoqwen_format import open_model
from nanoqwen_format.synthetic import tiny_config

SMALL = ["--device", "cpu", "--prompt-tokens", 20, "--gen-tokens", 4, "--runs", 2, "--warmup", 1]


def _expected_weight_bytes(config: dict) -> int:
    """INT4 words (K/8 uint32 per row) + fp16 scales (K/128 per row) + fp16 lm_head, from the dims alone."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * d
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]  # q k v o gate up down: [N, K]
    per_layer = sum(n * (k // 8) * 4 + n * (k // 128) * 2 for n, k in shapes)
    return config["num_hidden_layers"] * per_layer + v * h * 2


def test_synthetic_tiny_written_once_then_benched_as_table_and_json(invoke):
    table = invoke(["bench", "--synthetic", "tiny", *SMALL])
    assert table.exit_code == 0, table.output
    assert "writing a synthetic tiny model" in table.stderr
    for word in ("prefill", "decode", "ms/token", "GB/s", "copy bandwidth", "peak host RSS"):
        assert word in table.stdout
    cache = os.environ["NANOQWEN_CACHE"]
    (path,) = (os.path.join(cache, n) for n in os.listdir(cache))
    mtime = os.stat(path).st_mtime_ns

    result = invoke(["bench", "--synthetic", "tiny", *SMALL, "--json"])
    assert result.exit_code == 0, result.output
    assert result.stderr == "", "the model is reused, and --json keeps stderr quiet"
    r = json.loads(result.stdout)
    assert r["model_path"] == path and os.stat(path).st_mtime_ns == mtime
    assert r["device"] == "cpu" and r["mode"] == "reference" and r["gpu_name"] is None
    assert len(r["runs"]) == 2
    for run in r["runs"]:
        assert run["prompt_tokens"] == 20, "the bench prompt is exactly --prompt-tokens long"
        assert 1 <= run["generated_tokens"] <= 4
        assert run["prefill_ms"] > 0
    assert r["decode_ms_per_token"] > 0 and r["prefill_ms"] > 0
    assert abs(r["decode_tok_s"] * r["decode_ms_per_token"] - 1e3) < 1e-6

    config = open_model(path).config
    assert r["weight_bytes_per_token"] == _expected_weight_bytes(config)
    assert r["kv_bytes_per_context_token"] == bandwidth.kv_bytes_per_token(config)
    want_bytes = r["weight_bytes_per_token"] + r["kv_bytes_per_context_token"] * (20 + 4 / 2)
    assert r["bytes_per_token"] == want_bytes
    assert abs(r["achieved_gbs"] - want_bytes / (r["decode_ms_per_token"] * 1e-3) / 1e9) < 1e-9
    assert abs(r["pct_of_copy_bw"] - 100 * r["achieved_gbs"] / r["copy_bw_gbs"]) < 1e-9

    other = json.loads(invoke(["bench", "--synthetic", "tiny", *SMALL, "--copy-bw", 1000, "--json"]).stdout)
    assert other["copy_bw_gbs"] == 1000
    assert abs(other["pct_of_copy_bw"] - other["achieved_gbs"] / 10) < 1e-9


def test_eager_is_refused_on_cpu(invoke, tiny_model):
    result = invoke(["bench", "--model", tiny_model, "--device", "cpu", "--eager"])
    assert result.exit_code == 2
    assert "--eager" in result.stderr and "CPU" in result.stderr


def test_model_and_synthetic_together_are_refused(invoke, tiny_model):
    result = invoke(["bench", "--model", tiny_model, "--synthetic", "tiny", "--device", "cpu"])
    assert result.exit_code == 2
    assert "--synthetic" in result.stderr


def test_decode_bytes_counts_the_tied_embedding_as_lm_head(tmp_path):
    from nanoqwen_format.synthetic import write_synthetic

    config = tiny_config(tie_word_embeddings=True)
    path = write_synthetic(tmp_path / "tied.nanoqwen", config, seed=1) or tmp_path / "tied.nanoqwen"
    nq = open_model(path)
    assert "lm_head.weight" not in nq.tensor_names
    counts = bandwidth.decode_bytes(nq)
    assert counts.projections + counts.scales + counts.lm_head == _expected_weight_bytes(nq.config)
