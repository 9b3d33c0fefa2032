"""The llama.cpp (and transformers) comparison tables of docs/PERF.md, from the JSON records of one run.

One markdown table per model: decode at depth 0 and at depth 512, prompt 512, and the aggregate batched
decode at 1 / 8 / 32 / 64 sequences; columns nanoqwen, llama.cpp, their speed ratio (nanoqwen / llama.cpp:
above 1 is nanoqwen faster) and, where a record exists, transformers and its ratio. A header line names the
date, the commits, llama.cpp's version and the GPU.

    python3 scripts/peer_tables.py --dir DIR [--commit C] [--date D]     # every model found in DIR
    python3 scripts/peer_tables.py --model "real 1.5B" --ours bench.json --llama llamacpp.json [...]

--dir finds, for each NAME that has any of them (scripts/gpu_all.sh section `peers` writes these names):
    bench-NAME.json              nanoqwen-cli bench --json: prompt 512 + 128 generated (decode at depth 512..640)
    bench-NAME-d0.json           nanoqwen-cli bench --prompt-tokens 1 --json: decode at depth 1..129
    bench-batch-NAME.json        scripts/bench_batch.py --json: 128 + 256 tokens at B = 1, 8, 32, 64
    llamacpp-NAME.json           scripts/peer_llamacpp.sh bench NAME: llama-bench (pp512, tg128, tg128 at
                                 -d 512) and llama-batched-bench (-npp 128 -ntg 256 -npl 1,8,32,64) records
    peer-transformers-NAME.json  scripts/peer_transformers.py --out (512 + 128, bf16 eager)

Which figure faces which (the same work on both sides):
- decode, depth 0: llama-bench tg128 (-p 0: 128 tokens from an empty cache) vs ours with a 1-token prompt;
- decode, depth 512: llama-bench tg128 -d 512 vs ours on the decode protocol (a 512-token prompt, then 128
  tokens: the decode steps run at context 513..639); transformers' protocol is the same as ours;
- prompt 512: llama-bench pp512 vs our prefill of the 512-token prompt;
- batched: llama-batched-bench S_TG (pl x 256 tokens over the generation time, per-sequence prompts not
  shared) vs scripts/bench_batch.py decode_tok_s (B x 255 tokens over the decode steps' time).
llama-bench figures are the median of its timed samples (ours and transformers' report medians too); the
mean that llama-bench prints (avg_ts) is given under the table where it differs by more than 2%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

BATCHES = (1, 8, 32, 64)


def load(path) -> dict | list | None:
    if path is None:
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def one_record(rec):
    """nanoqwen-cli bench --json writes one record, or a list of them for a sweep: the first one."""
    if isinstance(rec, list):
        return rec[0] if rec else None
    return rec


# ---- the figures of each side, as {row key: (tok/s, ms)} -------------------------------------------------


def llama_bench_row(rec: dict) -> dict:
    """One llama-bench -o json record: median tok/s over its samples, the ms of the median sample."""
    n = rec["n_prompt"] + rec["n_gen"]
    samples = rec.get("samples_ns") or [rec["avg_ns"]]
    med_s = statistics.median(samples) * 1e-9
    return {"tok_s": n / med_s, "ms": med_s * 1e3, "avg_ts": rec.get("avg_ts"), "n": n}


def llama_figures(rec: dict | None) -> dict:
    out: dict = {}
    if not rec:
        return out
    for b in (rec.get("bench") or []) + (rec.get("bench_depth512") or []):
        r = llama_bench_row(b)
        depth = b.get("n_depth", 0) or 0
        if b["n_prompt"] == 512 and b["n_gen"] == 0 and depth == 0:
            out["prompt512"] = {"tok_s": r["tok_s"], "ms": r["ms"], "avg_ts": r["avg_ts"]}
        elif b["n_prompt"] == 0 and b["n_gen"] > 0 and depth in (0, 512):
            key = "decode_d0" if depth == 0 else "decode_d512"
            out[key] = {"tok_s": r["tok_s"], "ms": 1e3 / r["tok_s"], "avg_ts": r["avg_ts"]}
    for b in rec.get("batched") or []:
        pl, tg, t_tg = b.get("pl"), b.get("tg"), b.get("t_tg")
        if pl in BATCHES and b.get("speed_tg"):
            step = t_tg / tg * 1e3 if tg and t_tg else None
            out[f"batch{pl}"] = {"tok_s": b["speed_tg"], "ms": step}
    return out


def ours_figures(bench: dict | None, bench_d0: dict | None, batch: dict | None) -> dict:
    out: dict = {}
    bench, bench_d0 = one_record(bench), one_record(bench_d0)
    if bench and bench.get("decode_ms_per_token"):
        ms = bench["decode_ms_per_token"]
        out["decode_d512"] = {"tok_s": 1e3 / ms, "ms": ms}
    if bench and bench.get("prefill_ms") and bench.get("prompt_tokens"):
        ms = bench["prefill_ms"]
        out["prompt512"] = {"tok_s": bench["prompt_tokens"] / (ms * 1e-3), "ms": ms}
    if bench_d0 and bench_d0.get("decode_ms_per_token"):
        ms = bench_d0["decode_ms_per_token"]
        out["decode_d0"] = {"tok_s": 1e3 / ms, "ms": ms}
    for r in (batch or {}).get("results", []):
        if r.get("batch") in BATCHES:
            out[f"batch{r['batch']}"] = {"tok_s": r["decode_tok_s"], "ms": r.get("step_ms_mean")}
    return out


def transformers_figures(rec: dict | None) -> dict:
    out: dict = {}
    if not rec:
        return out
    if rec.get("decode_ms_per_token"):
        ms = rec["decode_ms_per_token"]
        out["decode_d512"] = {"tok_s": 1e3 / ms, "ms": ms}
    if rec.get("prefill_ms"):
        ms = rec["prefill_ms"]
        out["prompt512"] = {"tok_s": rec.get("prompt_tokens", 512) / (ms * 1e-3), "ms": ms}
    return out


# ---- formatting --------------------------------------------------------------------------------------------


def tok_s(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def cell(row: str, f: dict | None) -> str:
    if not f:
        return ""
    if row.startswith("decode"):
        return f"{f['ms']:.2f} ms/token ({tok_s(f['tok_s'])} tok/s)"
    if row == "prompt512":
        return f"{f['ms']:.1f} ms ({tok_s(f['tok_s'])} tok/s)"
    step = f" (step {f['ms']:.2f} ms)" if f.get("ms") else ""
    return f"{tok_s(f['tok_s'])} tok/s{step}"


def ratio(a: dict | None, b: dict | None) -> str:
    if not a or not b or not b.get("tok_s"):
        return ""
    return f"{a['tok_s'] / b['tok_s']:.2f}x"


ROWS = [("decode_d0", "decode, depth 0"), ("decode_d512", "decode, depth 512"), ("prompt512", "prompt 512")] + [
    (f"batch{b}", f"aggregate decode, {b} sequence{'s' if b > 1 else ''}") for b in BATCHES
]
LEGEND = ("Depth 0: llama-bench tg128 vs ours after a 1-token prompt; depth 512: tg128 -d 512 vs the decode "
          "protocol (a 512-token prompt, then 128 tokens); prompt 512: pp512; aggregate decode: "
          "llama-batched-bench S_TG vs scripts/bench_batch.py, B sequences of 128 + 256 tokens at once. "
          "Ratios are of speeds: above 1, nanoqwen is faster.")


def _first(*values):
    for v in values:
        if v:
            return v
    return None


def header(name: str, ours: dict, llama: dict | None, batch: dict | None, trf: dict | None,
           commit: str | None, date: str | None) -> str:
    ours = ours or {}
    lb = ((llama or {}).get("bench") or [{}])[0]
    gpu = _first(ours.get("gpu_name"), (batch or {}).get("gpu_name"), lb.get("gpu_info"), (trf or {}).get("gpu_name"))
    test_time = lb.get("test_time")
    date = _first(date, (batch or {}).get("date"), test_time[:10] if test_time else None, (trf or {}).get("date"))
    commit = _first(commit, (batch or {}).get("commit"), ours.get("commit"))
    parts = [f"**{name}**", gpu or "GPU unknown", date or "date unknown", f"nanoqwen {commit or 'unknown'}"]
    weights = (ours.get("engine_info") or {}).get("weights_bytes")
    if weights:
        parts[-1] += f" ({weights / 1e9:.2f} GB of weights, INT4 g128 + fp16 lm_head)"
    if llama:
        ids = [str(c) for c in llama.get("commit") or []]
        info = ids[1:]
        if lb.get("build_commit") not in (None, "unknown"):
            info.append(f"build {lb['build_commit']} ({lb.get('build_number')})")
        if lb.get("model_type"):
            info.append(lb["model_type"] + (f", {lb['model_size'] / 1e9:.2f} GB" if lb.get("model_size") else ""))
        info.append("CUDA, flash attention on")
        parts.append(f"llama.cpp {ids[0][:7] if ids else 'version unknown'} ({'; '.join(info)})")
    if trf:
        parts.append(f"transformers {trf.get('transformers_version', '?')} (torch {trf.get('torch_version', '?')}, "
                     f"{trf.get('dtype', '?')} {trf.get('mode', '')})".replace(" )", ")"))
    return f"{parts[0]}: " + ", ".join(parts[1:])


def table(name: str, *, ours=None, ours_d0=None, batch=None, llama=None, transformers=None,
          commit: str | None = None, date: str | None = None) -> str:
    """The markdown of one model's comparison (a header line, the table, footnotes)."""
    o = ours_figures(ours, ours_d0, batch)
    la = llama_figures(llama)
    tr = transformers_figures(transformers)
    cols = ["", "nanoqwen", "llama.cpp", "nanoqwen / llama.cpp"]
    if tr:
        cols += ["transformers", "nanoqwen / transformers"]
    lines = [header(name, one_record(ours), llama, batch, transformers, commit, date), "",
             "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for key, label in ROWS:
        if key not in o and key not in la and key not in tr:
            continue
        cells = [label, cell(key, o.get(key)), cell(key, la.get(key)), ratio(o.get(key), la.get(key))]
        if tr:
            cells += [cell(key, tr.get(key)), ratio(o.get(key), tr.get(key))]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [LEGEND]
    for key, label in (("decode_d0", "tg128"), ("decode_d512", "tg128 at depth 512"), ("prompt512", "pp512")):
        f = la.get(key)
        if f and f.get("avg_ts") and abs(f["avg_ts"] / f["tok_s"] - 1) > 0.02:
            notes.append(f"{label} {tok_s(f['avg_ts'])} tok/s")
    if len(notes) > 1:
        notes[1:] = ["llama-bench's own mean (avg_ts, over every sample) where it differs from the median: "
                     + ", ".join(notes[1:]) + "."]
    lines += ["", " ".join(notes)]
    return "\n".join(lines) + "\n"


NAMES = {"7b": "7B-shaped (random weights, the Qwen2.5-Coder-7B dims)",
         "real-1.5b": "real Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF; ours converted from it)"}


def from_dir(d: Path, commit: str | None, date: str | None) -> list[str]:
    names = set()
    for pattern, cut in (("llamacpp-*.json", "llamacpp-"), ("bench-batch-*.json", "bench-batch-"),
                         ("peer-transformers-*.json", "peer-transformers-")):
        names |= {p.name[len(cut):-len(".json")] for p in d.glob(pattern)}
    names |= {p.name[len("bench-"):-len(".json")] for p in d.glob("bench-*.json")
              if not p.name.startswith("bench-batch-") and not p.name.endswith("-d0.json")}
    order = sorted(names, key=lambda n: (list(NAMES).index(n) if n in NAMES else len(NAMES), n))
    out = []
    for n in order:
        out.append(table(NAMES.get(n, n), ours=load(d / f"bench-{n}.json"), ours_d0=load(d / f"bench-{n}-d0.json"),
                         batch=load(d / f"bench-batch-{n}.json"), llama=load(d / f"llamacpp-{n}.json"),
                         transformers=load(d / f"peer-transformers-{n}.json"), commit=commit, date=date))
    return out


def _git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                           cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, help="a directory of records named as above: one table per model")
    ap.add_argument("--model", help="one table: its title (with --ours/--ours-d0/--batch/--llama/--transformers)")
    ap.add_argument("--ours", help="nanoqwen-cli bench --json (512 + 128)")
    ap.add_argument("--ours-d0", help="nanoqwen-cli bench --prompt-tokens 1 --json")
    ap.add_argument("--batch", help="scripts/bench_batch.py --json")
    ap.add_argument("--llama", help="scripts/peer_llamacpp.sh bench's llamacpp-NAME.json")
    ap.add_argument("--transformers", help="scripts/peer_transformers.py --out")
    ap.add_argument("--commit", help="nanoqwen's commit (default: the batch record's, else git's HEAD)")
    ap.add_argument("--date", help="default: the batch record's, else llama-bench's test time")
    a = ap.parse_args(argv)
    if (a.dir is None) == (a.model is None):
        ap.error("give --dir or --model")
    commit = a.commit
    if a.dir is not None:
        if commit is None and not any(a.dir.glob("bench-batch-*.json")):
            commit = _git_commit()
        tables = from_dir(a.dir, commit, a.date)
        if not tables:
            print(f"no records in {a.dir}", file=sys.stderr)
            return 1
    else:
        if commit is None and not a.batch:
            commit = _git_commit()
        tables = [table(a.model, ours=load(a.ours), ours_d0=load(a.ours_d0), batch=load(a.batch),
                        llama=load(a.llama), transformers=load(a.transformers), commit=commit, date=a.date)]
    print(f"<!-- scripts/peer_tables.py, {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC -->\n")
    print("\n".join(tables), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
