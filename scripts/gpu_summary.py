"""The summary table gpu_all.sh prints last: one row per section, then the ladder's and the bench's figures.

    python3 scripts/gpu_summary.py SECTIONS_TSV LADDER_DIR OUT_DIR

SECTIONS_TSV rows: name, exit code, seconds, log path. A pytest section's result is its last summary line
("3 passed, 1 skipped in 12.3s"); exit code 124/137 is a timeout.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

_PYTEST = re.compile(r"\b\d+ (passed|failed|skipped|error|errors|deselected|xfailed)\b")


def pytest_line(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        if _PYTEST.search(line):
            return line.strip("= ").strip()
    return ""


def verdict(rc: int) -> str:
    return {0: "ok", 5: "no tests"}.get(rc, "TIMEOUT" if rc in (124, 137) else f"FAIL rc={rc}")


def sections(tsv: Path) -> list[str]:
    rows = [r.split("\t") for r in tsv.read_text().splitlines() if r.strip()]
    out = [f"{'section':28s} {'result':12s} {'s':>5s}  detail"]
    for name, rc, secs, log in rows:
        detail = pytest_line(Path(log))
        if not detail:
            tail = [ln for ln in Path(log).read_text(errors="replace").splitlines() if ln.strip()][-1:] \
                if Path(log).exists() else []
            detail = tail[0][:80] if tail else ""
        out.append(f"{name:28s} {verdict(int(rc)):12s} {int(secs):5d}  {detail[:90]}")
    return out


def _load(p: Path) -> dict | None:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def ladder(d: Path) -> list[str]:
    out = []
    for name in ("tiny", "7b"):
        lay = _load(d / f"layer_{name}.json")
        if lay:
            out.append(f"layer {name:4s}: block rel err prefill {lay['block_prefill_rel']:.2e} decode "
                       f"{lay['block_decode_rel']:.2e} (bound {lay['block_bound']:.0e}); lm_head {lay['head_rel']:.2e}"
                       f" (bound {lay['head_bound']:.0e})")
        g = _load(d / f"graph_{name}.json")
        if g:
            s = g.get("score", {})
            out.append(f"graph {name:4s}: {g['n_prompts']} prompts x {g['max_tokens']} tok: {g['n_exact']} identical, "
                       f"{g['n_near_tie']} near-tie, {g['n_bad']} bad, {100 * g['match_fraction']:.1f}% tokens "
                       f"match; score() rel {s.get('rel', float('nan')):.2e} max|d| {s.get('max_abs', float('nan')):.3f}")
            info = g.get("info", {})
            if info:
                out.append(f"           launcher calls/token {info.get('launcher_calls_per_token')}, graph kernel "
                           f"nodes {info.get('graph_kernel_nodes_greedy')}, upload {info.get('upload_GBps', 0):.1f} GB/s")
    e = _load(d / "engine_7b.json")
    if e:
        i = e["info"]
        out.append(f"7B Engine.load: {i.get('load_s', 0):.2f} s total, upload {i.get('upload_s', 0):.2f} s "
                   f"({i.get('upload_GBps', 0):.1f} GB/s), weights {i.get('weights_bytes', 0) / 1e9:.2f} GB, "
                   f"KV {i.get('kv_bytes', 0) / 1e9:.2f} GB; {len(e['tokens'])} tokens streamed")
    sp = _load(d / "speed_7b.json")
    if sp:
        for mode, r in sp.items():
            out.append(f"7B {mode:5s} decode {r['decode_ms_per_token']:.2f} ms/token, prefill-512 {r['prefill_ms']:.1f} ms"
                       f" ({r['launcher_calls_per_token']} launcher calls, {r['graph_kernel_nodes']} graph kernel nodes)")
    return out


def bench(out_dir: Path) -> list[str]:
    out = []
    for mode in ("graph", "eager"):
        b = _load(out_dir / f"bench_7b_{mode}.json")
        if not b:
            continue
        keys = ("decode_ms_per_token", "prefill_ms", "decode_tok_s", "achieved_GBps", "pct_of_copy_bw",
                "peak_gpu_bytes", "gpu_name")
        shown = ", ".join(f"{k}={b[k]:.4g}" if isinstance(b.get(k), float) else f"{k}={b[k]}"
                          for k in keys if k in b)
        out.append(f"cli bench 7b {mode}: {shown or json.dumps(b)[:200]}")
    bb = _load(out_dir / "bench_batch_7b.json")
    for r in (bb or {}).get("results", []):
        out.append(f"batch bench 7b B={r['batch']:2d}: {r['decode_tok_s']:7.0f} tok/s decode, step "
                   f"{r['step_ms_mean']:.3f} ms, itl p50/p99 {r['itl_ms_p50']:.3f}/{r['itl_ms_p99']:.3f} ms, "
                   f"ttft p50 {r['ttft_ms_p50']:.1f} ms")
    return out


def main() -> None:
    tsv, lad, out = (Path(a) for a in sys.argv[1:4])
    lines = ["", "================ nanoqwen GPU summary ================"]
    lines += sections(tsv)
    extra = ladder(lad) + bench(out)
    if extra:
        lines += ["", *extra]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
