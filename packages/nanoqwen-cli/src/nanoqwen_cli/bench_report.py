"""How `bench` prints its records: a markdown table (llama-bench's layout: one row per test, the median
beside mean ± stddev), CSV, or JSON.

A record is a dict (bench_cmd._summary for the single-stream protocol, bench_concurrency for the
concurrent one); JSON prints it as it is: one object for one test, a list for a sweep.
"""

from __future__ import annotations

import csv
import io
import json
import statistics

from nanoqwen_cli.display import rate


def spread(values) -> dict:
    """median, mean and sample stddev (None with fewer than two values) of the non-None values."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"median": None, "mean": None, "stddev": None}
    return {
        "median": statistics.median(xs),
        "mean": statistics.fmean(xs),
        "stddev": statistics.stdev(xs) if len(xs) > 1 else None,
    }


def mean_sd(s: dict) -> str:
    if s["mean"] is None:
        return "n/a"
    return rate(s["mean"]) + (f" ± {rate(s['stddev'])}" if s["stddev"] is not None else "")


def gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    right = ["---:" if i else ":---" for i in range(len(header))]
    return ["| " + " | ".join(r) + " |" for r in [header, right, *rows]]


def _preamble(r: dict) -> list[str]:
    where = r["device"] + (f" ({r['gpu_name']})" if r.get("gpu_name") else "")
    runs = f"{r['n_runs']} timed run{'s' if r['n_runs'] > 1 else ''} after {r['warmup']} warm-up"
    memory = (
        f"peak GPU {gib(r.get('peak_gpu_mem_bytes'))} (device-wide), CuPy pool {gib(r.get('gpu_pool_bytes'))}, "
        if r["device"] == "cuda"
        else ""
    ) + f"peak host RSS {gib(r.get('peak_host_rss_bytes'))}"
    return [
        f"model: {r['model']} [{r['model_path']}]",
        f"device: {where}, mode {r['mode']}, load {r['load_s']:.2f} s; greedy, {runs}",
        f"memory: {memory}",
        "",
    ]


def markdown(records: list[dict]) -> str:
    first = records[0]
    lines = _preamble(first)
    if "levels" in first:
        header = ["test", "concurrency", "tok/s (median)", "tok/s (mean ± sd)", "decode tok/s", "TTFT p50", "TTFT p99",
                  "ITL p50", "ITL p99", "preempted"]  # fmt: skip
        rows = [
            [
                f"pp{r['prompt_tokens']} tg{r['gen_tokens']}",
                str(lv["concurrency"]),
                rate(lv["aggregate_tok_s"]),
                mean_sd(lv["aggregate_tok_s_spread"]),
                rate(lv.get("decode_tok_s")),
                f"{lv['ttft_ms_p50']:.1f} ms",
                f"{lv['ttft_ms_p99']:.1f} ms",
                f"{lv['itl_ms_p50']:.2f} ms",
                f"{lv['itl_ms_p99']:.2f} ms",
                str(lv["preemptions"]),
            ]  # fmt: skip
            for r in records
            for lv in r["levels"]
        ]
        return "\n".join(lines + _md_table(header, rows))
    with_bw = first["copy_bw_gbs"] is not None
    header = ["test", "prefill tok/s", "prefill tok/s (mean ± sd)", "decode tok/s", "decode tok/s (mean ± sd)",
              "decode ms/token", "GB/s"] + ([f"% of {first['copy_bw_gbs']:,.0f} GB/s copy"] if with_bw else [])  # fmt: skip
    rows = []
    for r in records:
        row = [f"pp{r['prompt_tokens']} tg{r['gen_tokens']}", rate(r["prefill_tok_s"]),
               mean_sd(r["prefill_tok_s_spread"]), rate(r["decode_tok_s"]), mean_sd(r["decode_tok_s_spread"]),
               "n/a" if r["decode_ms_per_token"] is None else f"{r['decode_ms_per_token']:.3g}",
               rate(r["achieved_gbs"])]  # fmt: skip
        if with_bw:
            row.append("n/a" if r["pct_of_copy_bw"] is None else f"{r['pct_of_copy_bw']:.1f}%")
        rows.append(row)
    lines += _md_table(header, rows)
    lines += [
        "",
        f"GB/s: the bytes a decode token reads ({first['weight_bytes_per_token'] / 1e9:.3f} GB of weights + "
        f"{first['kv_bytes_per_context_token'] / 1024:.0f} KiB of K/V per token of context, at the mean context) "
        "over the median ms/token; tok/s columns are medians unless marked.",
    ]
    short = [r for r in records if r["min_generated"] < r["gen_tokens"]]
    for r in short:
        lines.append(f"note: pp{r['prompt_tokens']} tg{r['gen_tokens']}: some runs stopped early "
                     f"(generated {r['min_generated']} of {r['gen_tokens']} tokens)")  # fmt: skip
    return "\n".join(lines)


# Scalar fields of a record, in CSV column order (one row per test, or per concurrency level).
CSV_FIELDS = ["model", "model_path", "device", "gpu_name", "mode", "prompt_tokens", "gen_tokens", "n_runs",
              "prefill_ms", "prefill_tok_s", "prefill_tok_s_mean", "prefill_tok_s_stddev",
              "decode_ms_per_token", "decode_tok_s", "decode_tok_s_mean", "decode_tok_s_stddev",
              "achieved_gbs", "copy_bw_gbs", "pct_of_copy_bw", "load_s", "peak_host_rss_bytes",
              "peak_gpu_mem_bytes"]  # fmt: skip
CSV_LEVEL_FIELDS = ["concurrency", "aggregate_tok_s", "aggregate_tok_s_mean",
                    "aggregate_tok_s_stddev", "decode_tok_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99",
                    "preemptions"]  # fmt: skip


def _flat(r: dict) -> dict:
    out = dict(r)
    for name in ("prefill_tok_s", "decode_tok_s", "aggregate_tok_s"):
        s = r.get(f"{name}_spread")
        if s:
            out[f"{name}_mean"], out[f"{name}_stddev"] = s["mean"], s["stddev"]
    return out


def to_csv(records: list[dict]) -> str:
    buf = io.StringIO()
    if "levels" in records[0]:
        fields = [f for f in CSV_FIELDS if not f.startswith(("prefill", "decode", "achieved", "copy", "pct"))]
        w = csv.DictWriter(buf, fields + CSV_LEVEL_FIELDS, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        for r in records:
            for lv in r["levels"]:
                w.writerow({**_flat(r), **_flat(lv)})
    else:
        w = csv.DictWriter(buf, CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        for r in records:
            w.writerow(_flat(r))
    return buf.getvalue().rstrip("\n")


def to_json(records: list[dict]) -> str:
    return json.dumps(records[0] if len(records) == 1 else records)


FORMATS = {"md": markdown, "csv": to_csv, "json": to_json}
