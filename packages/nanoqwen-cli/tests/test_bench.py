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


def test_synthetic_tiny_json_record(invoke, tmp_path):
    result = invoke(["bench", "--synthetic", "tiny", *SMALL, "--json"])
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout)
    assert r["device"] == "cpu" and r["mode"] == "reference" and r["gpu_name"] is None
    assert len(r["runs"]) == 2
    for run in r["runs"]:
        assert run["prompt_tokens"] == 20, "the bench prompt is exactly --prompt-tokens long"
        assert 1 <= run["generated_tokens"] <= 4
        assert run["prefill_ms"] > 0
    assert r["decode_ms_per_token"] > 0 and r["prefill_ms"] > 0
    assert abs(r["decode_tok_s"] * r["decode_ms_per_token"] - 1e3) < 1e-6

    config = open_model(r["model_path"]).config
    assert r["weight_bytes_per_token"] == _expected_weight_bytes(config)
    assert r["kv_bytes_per_context_token"] == bandwidth.kv_bytes_per_token(config)
    want_bytes = r["weight_bytes_per_token"] + r["kv_bytes_per_context_token"] * (20 + 4 / 2)
    assert r["bytes_per_token"] == want_bytes
    assert abs(r["achieved_gbs"] - want_bytes / (r["decode_ms_per_token"] * 1e-3) / 1e9) < 1e-9
    assert abs(r["pct_of_copy_bw"] - 100 * r["achieved_gbs"] / r["copy_bw_gbs"]) < 1e-9
    assert r["model_path"].startswith(os.environ["NANOQWEN_CACHE"])


def test_synthetic_model_is_written_once_and_reused(invoke):
    first = invoke(["bench", "--synthetic", "tiny", *SMALL, "--runs", 1, "--warmup", 0])
    assert first.exit_code == 0, first.output
    assert "writing a synthetic tiny model" in first.stderr
    (path,) = (
        os.path.join(os.environ["NANOQWEN_CACHE"], n) for n in os.listdir(os.environ["NANOQWEN_CACHE"])
    )
    mtime = os.stat(path).st_mtime_ns
    second = invoke(["bench", "--synthetic", "tiny", *SMALL, "--runs", 1, "--warmup", 0])
    assert second.exit_code == 0, second.output
    assert "writing a synthetic" not in second.stderr
    assert os.stat(path).st_mtime_ns == mtime
    for line in ("prefill", "decode", "GB/s", "copy bandwidth", "peak host RSS"):
        assert line in second.stdout


def test_copy_bw_flag_scales_the_percentage(invoke, tiny_model):
    base = ["bench", "--model", tiny_model, *SMALL, "--runs", 1, "--warmup", 0, "--json"]
    r = json.loads(invoke([*base, "--copy-bw", 1000]).stdout)
    assert r["copy_bw_gbs"] == 1000
    assert abs(r["pct_of_copy_bw"] - r["achieved_gbs"] / 10) < 1e-9


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
