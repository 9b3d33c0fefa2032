"""scripts/peer_tables.py (the llama.cpp / transformers comparison tables of docs/PERF.md) on the records
kept in docs/perf/ and on small synthetic ones: which rows appear, which figures face which, the ratios.
CPU only: it reads JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scripts_import import load_script

ROOT = Path(__file__).resolve().parents[1]
PERF = ROOT / "docs" / "perf"


@pytest.fixture(scope="module")
def pt():
    return load_script("peer_tables")


def rows(md: str) -> dict[str, list[str]]:
    """{first cell: the other cells} of the markdown table's body rows."""
    out = {}
    for line in md.splitlines():
        if line.startswith("| ") and not line.startswith("|  |") and "---" not in line:
            cells = [c.strip() for c in line.strip("|").split("|")]
            out[cells[0]] = cells[1:]
    return out


def llama_bench(n_prompt, n_gen, depth, samples_ns):
    return {"n_prompt": n_prompt, "n_gen": n_gen, "n_depth": depth, "samples_ns": samples_ns,
            "avg_ns": sum(samples_ns) / len(samples_ns),
            "avg_ts": sum((n_prompt + n_gen) / (s * 1e-9) for s in samples_ns) / len(samples_ns),
            "gpu_info": "NVIDIA H200", "build_commit": "unknown", "model_type": "qwen2 7B Q4_K - Medium",
            "model_size": 4_680_000_000, "test_time": "2026-12-01T10:00:00Z"}


@pytest.fixture
def records(tmp_path):
    """A run of gpu_all.sh's `peers` section for one model, numbers chosen to give round ratios."""
    llama = {
        "model": "7b", "commit": ["0c1e57098bba43ac29e6e3b677cdceebdd22334f", "llama-cpp-python==0.3.36"],
        # pp512 in 20 ms (a slow first sample: the median, not the mean, is the figure), tg128 at 200 tok/s
        "bench": [llama_bench(512, 0, 0, [40e6, 20e6, 20e6, 20e6, 20e6]),
                  llama_bench(0, 128, 0, [640e6] * 5)],
        "bench_depth512": [llama_bench(0, 128, 512, [800e6] * 5)],  # 160 tok/s at depth 512
        "batched": [{"pl": b, "pp": 128, "tg": 256, "t_tg": 1.0, "speed_tg": 100.0 * b, "speed_pp": 1.0}
                    for b in (1, 8, 32, 64)],
    }
    ours = {"gpu_name": "NVIDIA H200", "prompt_tokens": 512, "gen_tokens": 128, "prefill_ms": 10.0,
            "decode_ms_per_token": 2.5, "engine_info": {"weights_bytes": 5_545_257_984}}  # 400 tok/s
    ours_d0 = [{**ours, "prompt_tokens": 1, "decode_ms_per_token": 2.0}]  # a sweep's list: 500 tok/s
    batch = {"gpu_name": "NVIDIA H200", "date": "2026-12-01", "commit": "abc1234",
             "results": [{"batch": b, "decode_tok_s": 150.0 * b, "step_ms_mean": 1.0} for b in (1, 8, 32, 64)]}
    trf = {"transformers_version": "5.17.0", "torch_version": "2.11", "dtype": "bfloat16", "mode": "eager",
           "prompt_tokens": 512, "prefill_ms": 20.0, "decode_ms_per_token": 20.0}
    for name, rec in (("llamacpp-7b", llama), ("bench-7b", ours), ("bench-7b-d0", ours_d0),
                      ("bench-batch-7b", batch), ("peer-transformers-7b", trf)):
        (tmp_path / f"{name}.json").write_text(json.dumps(rec))
    return tmp_path


def test_synthetic_ratios(pt, records, capsys):
    assert pt.main(["--dir", str(records)]) == 0
    md = capsys.readouterr().out
    r = rows(md)
    assert r["decode, depth 0"][:3] == ["2.00 ms/token (500 tok/s)", "5.00 ms/token (200 tok/s)", "2.50x"]
    assert r["decode, depth 512"] == ["2.50 ms/token (400 tok/s)", "6.25 ms/token (160 tok/s)", "2.50x",
                                      "20.00 ms/token (50.0 tok/s)", "8.00x"]
    assert r["prompt 512"][:3] == ["10.0 ms (51,200 tok/s)", "20.0 ms (25,600 tok/s)", "2.00x"]
    assert r["prompt 512"][3:] == ["20.0 ms (25,600 tok/s)", "2.00x"]
    for b in (1, 8, 32, 64):
        key = f"aggregate decode, {b} sequence{'s' if b > 1 else ''}"
        assert r[key][2] == "1.50x"
        assert r[key][3:] == ["", ""]  # no transformers figure for batches
    assert "abc1234" in md and "2026-12-01" in md and "0c1e570" in md and "NVIDIA H200" in md
    assert "transformers 5.17.0" in md
    assert "pp512 23,040 tok/s" in md  # llama-bench's mean of the samples' tok/s: (12,800 + 4 x 25,600) / 5


def test_missing_peers_leave_cells_empty(pt, records, capsys):
    (records / "peer-transformers-7b.json").unlink()
    (records / "bench-7b-d0.json").unlink()
    (records / "bench-batch-7b.json").write_text("{not json")  # a step that died mid-write
    assert pt.main(["--dir", str(records), "--commit", "fedcba9"]) == 0
    md = capsys.readouterr().out
    r = rows(md)
    assert "transformers" not in md.split("\n\n")[1].splitlines()[0]  # no transformers columns
    assert r["decode, depth 0"] == ["", "5.00 ms/token (200 tok/s)", ""]
    assert r["aggregate decode, 64 sequences"] == ["", "6,400 tok/s (step 3.91 ms)", ""]
    assert "nanoqwen fedcba9" in md


def test_two_models_in_order(pt, records, capsys):
    for p in records.glob("*-7b*.json"):
        p.with_name(p.name.replace("-7b", "-real-1.5b")).write_text(p.read_text())
    assert pt.main(["--dir", str(records)]) == 0
    md = capsys.readouterr().out
    assert md.index("**7B-shaped") < md.index("**real Qwen2.5-Coder-1.5B")
    assert md.count("| decode, depth 512 |") == 2


def test_recorded_real_1_5b(pt, capsys):
    """The real 1.5B's records of lease 89bf7ec (docs/PERF.md): 725 tok/s against llama.cpp's 574 at depth
    512 (the median of its 5 samples), pp512 20.2 ms against 18.3."""
    assert pt.main(["--model", "real 1.5B", "--ours", str(PERF / "bench-real-1.5b-89bf7ec.json"),
                    "--llama", str(PERF / "llamacpp-real-1.5b-89bf7ec.json"), "--commit", "89bf7ec"]) == 0
    md = capsys.readouterr().out
    r = rows(md)
    assert r["decode, depth 512"] == ["1.38 ms/token (725 tok/s)", "1.74 ms/token (574 tok/s)", "1.26x"]
    assert r["prompt 512"] == ["20.2 ms (25,326 tok/s)", "18.3 ms (27,973 tok/s)", "0.91x"]
    assert r["decode, depth 0"] == ["", "1.78 ms/token (562 tok/s)", ""]
    assert r["aggregate decode, 64 sequences"] == ["", "7,687 tok/s (step 8.33 ms)", ""]
    assert "llama.cpp 0c1e570" in md and "nanoqwen 89bf7ec" in md


def test_recorded_7b_with_transformers(pt, capsys):
    assert pt.main(["--model", "7B", "--ours", str(PERF / "bench-7b-graph-5b82b01.json"),
                    "--batch", str(PERF / "bench-batch-7b-tiles-c89cb93.json"),
                    "--transformers", str(PERF / "peer-transformers-31e43d6.json")]) == 0
    r = rows(capsys.readouterr().out)
    assert r["decode, depth 512"][0] == "2.08 ms/token (480 tok/s)"
    assert r["decode, depth 512"][3:] == ["17.89 ms/token (55.9 tok/s)", "8.59x"]
    assert r["aggregate decode, 32 sequences"][0] == "5,139 tok/s (step 6.23 ms)"
    assert "decode, depth 0" not in r  # no figure on either side: no row


def test_needs_dir_or_model(pt):
    with pytest.raises(SystemExit):
        pt.main([])
