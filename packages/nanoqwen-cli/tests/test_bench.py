"""`nanoqwen-cli bench` on the CPU reference with a synthetic tiny model, small settings."""

from __future__ import annotations

import csv
import io
import json
import os
import statistics

import pytest
from nanoqwen_cli import bandwidth, display
from nanoqwen_format import open_model
from nanoqwen_format.synthetic import tiny_config

SMALL = ["--device", "cpu", "--prompt-tokens", 20, "--gen-tokens", 4, "--runs", 3, "--warmup", 1]


def _expected_weight_bytes(config: dict, lm_head_dtype: str) -> int:
    """INT4 words (K/8 uint32 per row) + fp16 scales (K/128 per row) + the lm_head (fp16; or int8 bytes and
    an fp16 scale per 128 values), from the dims alone."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * d
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]  # q k v o gate up down: [N, K]
    per_layer = sum(n * (k // 8) * 4 + n * (k // 128) * 2 for n, k in shapes)
    head = v * h * 2 if lm_head_dtype == "fp16" else v * h + v * (h // 128) * 2
    return config["num_hidden_layers"] * per_layer + head


def test_synthetic_tiny_written_once_then_benched_as_markdown_and_json(invoke):
    table = invoke(["bench", "--synthetic", "tiny", *SMALL])
    assert table.exit_code == 0, table.output
    assert "writing a synthetic tiny model" in table.stderr
    lines = table.stdout.splitlines()
    header = next(x for x in lines if x.startswith("| test"))
    for word in ("prefill tok/s", "(mean ± sd)", "decode tok/s", "decode ms/token", "GB/s"):
        assert word in header, word
    assert "copy" not in table.stdout, "a CPU run is not compared with the H200's copy bandwidth"
    (row,) = [x for x in lines if x.startswith("| pp20 tg4 |")]
    assert "±" in row and "peak host RSS" in table.stdout
    cache = os.environ["NANOQWEN_CACHE"]
    (path,) = (os.path.join(cache, n) for n in os.listdir(cache) if n.endswith(".nanoqwen"))
    assert not [n for n in os.listdir(cache) if n.endswith(".tmp")], "no temporary left behind"
    mtime = os.stat(path).st_mtime_ns

    result = invoke(["bench", "--synthetic", "tiny", *SMALL, "--json"])
    assert result.exit_code == 0, result.output
    assert result.stderr == "", "the model is reused, and --json keeps stderr quiet"
    r = json.loads(result.stdout)
    assert r["model_path"] == path and os.stat(path).st_mtime_ns == mtime
    assert r["device"] == "cpu" and r["mode"] == "reference" and r["gpu_name"] is None
    assert len(r["runs"]) == 3
    for run in r["runs"]:
        assert run["prompt_tokens"] == 20, "the bench prompt is exactly --prompt-tokens long"
        assert run["generated_tokens"] == 4, "ignore_eos: every run generates --gen-tokens"
        assert run["prefill_ms"] > 0
    assert r["decode_ms_per_token"] > 0 and r["prefill_ms"] > 0
    assert abs(r["decode_tok_s"] * r["decode_ms_per_token"] - 1e3) < 1e-6
    per_run = [run["decode_tok_s"] for run in r["runs"]]
    s = r["decode_tok_s_spread"]
    assert s["mean"] == pytest.approx(statistics.fmean(per_run)) and s["stddev"] == pytest.approx(
        statistics.stdev(per_run)
    )
    assert s["median"] == pytest.approx(statistics.median(per_run))
    assert r["copy_bw_gbs"] is None and r["pct_of_copy_bw"] is None

    config = open_model(path).config
    assert r["engine_info"]["lm_head_dtype"] == "int8"  # the default: the head's bytes counted as int8
    assert r["weight_bytes_per_token"] == _expected_weight_bytes(config, "int8")
    assert r["kv_bytes_per_context_token"] == bandwidth.kv_bytes_per_token(config)
    want_bytes = r["weight_bytes_per_token"] + r["kv_bytes_per_context_token"] * (20 + 4 / 2)
    assert r["bytes_per_token"] == want_bytes
    assert abs(r["achieved_gbs"] - want_bytes / (r["decode_ms_per_token"] * 1e-3) / 1e9) < 1e-9

    other = json.loads(
        invoke(["bench", "--synthetic", "tiny", *SMALL, "--copy-bw", 1000, "--format", "json"]).stdout
    )
    assert other["copy_bw_gbs"] == 1000
    assert abs(other["pct_of_copy_bw"] - other["achieved_gbs"] / 10) < 1e-9


def test_sweep_gives_one_row_per_test_in_every_format(invoke):
    args = [
        "bench",
        "--synthetic",
        "tiny",
        "--device",
        "cpu",
        "--prompt-tokens",
        "16,24",
        "--gen-tokens",
        "3,5",
    ]
    args += ["--runs", 1, "--warmup", 0]
    records = json.loads(invoke([*args, "--json"]).stdout)
    assert [(r["prompt_tokens"], r["gen_tokens"]) for r in records] == [(16, 3), (16, 5), (24, 3), (24, 5)]
    for r in records:
        assert all(run["prompt_tokens"] == r["prompt_tokens"] for run in r["runs"])
        assert r["decode_tok_s_spread"]["stddev"] is None, "one run has no spread"
    rows = list(csv.DictReader(io.StringIO(invoke([*args, "--format", "csv"]).stdout)))
    assert [(int(x["prompt_tokens"]), int(x["gen_tokens"])) for x in rows] == [
        (16, 3),
        (16, 5),
        (24, 3),
        (24, 5),
    ]
    assert all(float(x["decode_tok_s"]) > 0 for x in rows)
    md = invoke([*args, "--format", "md"]).stdout
    assert [x.split(" |")[0] for x in md.splitlines() if x.startswith("| pp")] == [
        "| pp16 tg3",
        "| pp16 tg5",
        "| pp24 tg3",
        "| pp24 tg5",
    ]


def test_concurrency_levels_through_the_batched_api(invoke):
    args = ["bench", "--synthetic", "tiny", "--device", "cpu", "--prompt-tokens", 12, "--gen-tokens", 5]
    args += ["--runs", 1, "--warmup", 0, "--concurrency", "1,3"]
    r = json.loads(invoke([*args, "--json"]).stdout)
    assert [lv["concurrency"] for lv in r["levels"]] == [1, 3]
    for lv in r["levels"]:
        n = lv["concurrency"]
        assert lv["generated_tokens"] == [n * 5], "every request generates --gen-tokens"
        assert lv["aggregate_tok_s"] == pytest.approx(n * 5 / lv["wall_s"][0])
        assert lv["decode_tok_s"] > 0, "tokens arrive after every request's first one"
        assert 0 < lv["ttft_ms_p50"] <= lv["ttft_ms_p99"]
        assert 0 < lv["itl_ms_p50"] <= lv["itl_ms_p99"]
        assert lv["preemptions"] == 0, "the pool holds every request of the level"
    md = invoke(args).stdout
    assert "| TTFT p50 |" in md and "| pp12 tg5 | 3 |" in md


@pytest.mark.parametrize(
    ("x", "text"),
    [(27025.4, "27,025"), (464.04, "464.0"), (3.714, "3.71"), (0.04123, "0.0412"), (None, "n/a")],
)
def test_rates_keep_their_digits(x, text):
    assert display.rate(x) == text


def test_eager_is_refused_on_cpu(invoke, tiny_model):
    result = invoke(["bench", "--model", tiny_model, "--device", "cpu", "--eager"])
    assert result.exit_code == 2
    assert "--eager" in result.stderr and "CPU" in result.stderr


def test_model_and_synthetic_together_are_refused(invoke, tiny_model):
    result = invoke(["bench", "--model", tiny_model, "--synthetic", "tiny", "--device", "cpu"])
    assert result.exit_code == 2
    assert "--synthetic" in result.stderr


@pytest.mark.parametrize("value", ["0", "12,x", "", "-5"])
def test_bad_sweeps_are_usage_errors(invoke, tiny_model, value):
    result = invoke(["bench", "--model", tiny_model, "--device", "cpu", "--prompt-tokens", value])
    assert result.exit_code == 2 and "'--prompt-tokens'" in result.stderr, result.output


def test_decode_bytes_counts_the_tied_embedding_as_lm_head(tmp_path):
    from nanoqwen_format.synthetic import write_synthetic

    config = tiny_config(tie_word_embeddings=True)
    path = write_synthetic(tmp_path / "tied.nanoqwen", config, seed=1) or tmp_path / "tied.nanoqwen"
    nq = open_model(path)
    assert "lm_head.weight" not in nq.tensor_names
    for dtype in ("fp16", "int8"):
        counts = bandwidth.decode_bytes(nq, dtype)
        assert counts.projections + counts.scales + counts.lm_head == _expected_weight_bytes(nq.config, dtype)


def test_prefill_chunk_idle_reaches_the_engine(invoke):
    """--prefill-chunk-idle sets the engine's per-step prompt budget while nothing decodes (recorded in
    engine_info beside prefill_chunk, and never below it); by default the backend's (the CPU reference:
    prefill_chunk, 512); below 1 is a usage error."""
    got = json.loads(invoke(["bench", "--synthetic", "tiny", *SMALL, "--prefill-chunk-idle", 1024, "--json"]).stdout)
    assert got["engine_info"]["prefill_chunk_idle"] == 1024 and got["engine_info"]["prefill_chunk"] == 512
    assert all(run["prompt_tokens"] == 20 for run in got["runs"])
    low = json.loads(invoke(["bench", "--synthetic", "tiny", *SMALL, "--prefill-chunk-idle", 8, "--json"]).stdout)
    assert low["engine_info"]["prefill_chunk_idle"] == 512
    default = json.loads(invoke(["bench", "--synthetic", "tiny", *SMALL, "--json"]).stdout)
    assert default["engine_info"]["prefill_chunk_idle"] == 512
    bad = invoke(["bench", "--synthetic", "tiny", *SMALL, "--prefill-chunk-idle", 0])
    assert bad.exit_code == 2 and "prefill-chunk-idle" in bad.output


@pytest.mark.parametrize("flag,gpu_only,anywhere,bad,choices", [
    ("--prefill-weights", "fp8", "auto", "bf16", ("fp8", "int4")),
    ("--decode-activations", "int8", "fp16", "int4", ("int8", "fp16")),
])
def test_gpu_numerics_choices_are_checked(invoke, flag, gpu_only, anywhere, bad, choices):
    """--prefill-weights (what the GPU's prefill GEMMs multiply; fp8 opt-in) and --decode-activations (the
    GPU's batch-1 decode GEMVs; int8 by default there): the CPU reference has no such choice, so asking it
    for the GPU-only value is one clear error, not a traceback; the value closest to what the reference
    computes (auto / fp16) is accepted anywhere; an unknown value is a usage error naming the choices."""
    cpu = invoke(["bench", "--synthetic", "tiny", *SMALL, flag, gpu_only])
    assert cpu.exit_code != 0 and "Traceback" not in cpu.output
    assert f"{flag[2:].replace('-', '_')} applies to device='cuda' only" in cpu.output
    ok = json.loads(invoke(["bench", "--synthetic", "tiny", *SMALL, flag, anywhere, "--json"]).stdout)
    assert all(run["prompt_tokens"] == 20 for run in ok["runs"])
    wrong = invoke(["bench", "--synthetic", "tiny", *SMALL, flag, bad])
    assert wrong.exit_code == 2 and all(c in wrong.output for c in choices)
