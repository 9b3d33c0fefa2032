"""Conversion benchmark (not a test): a 7B-shaped synthetic Hugging Face checkpoint -> .nanoqwen.

Builds the checkpoint from the shipped Qwen2.5-Coder-7B-Instruct config with random weights (bf16,
sharded like the real one; ~15.2 GB) in a temporary folder, then converts it in a child process and
reports the child's wall time, source MB/s and peak RSS (the child's own rusage from os.wait4, so the
generator's memory is not counted). Needs ~21 GB of free disk (15.2 GB in + 5.5 GB out).

    .venv/bin/python scripts/bench_convert.py [--workdir /tmp] [--shards 4] [--dtype bfloat16] [--keep]
"""

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nanoqwen_format.synthetic import qwen7b_config, write_hf_checkpoint

CHILD = """
import sys
from nanoqwen_format import convert
convert(sys.argv[1], sys.argv[2], progress=False)
"""


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.suffix == ".safetensors")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=tempfile.gettempdir(), help="where the temporary folder goes")
    ap.add_argument("--shards", type=int, default=4, help="safetensors shards (Qwen2.5-7B ships 4)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and the output")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="nanoqwen-bench-", dir=args.workdir))
    free = shutil.disk_usage(work).free
    if free < 22e9:
        print(f"warning: {free / 1e9:.1f} GB free under {work}; the run needs ~21 GB", file=sys.stderr)
    try:
        t0 = time.perf_counter()
        src = write_hf_checkpoint(work / "hf", qwen7b_config(), seed=0, dtype=args.dtype, shards=args.shards)
        gen_s = time.perf_counter() - t0
        src_bytes = folder_bytes(src)
        dst = work / "model.nanoqwen"
        t0 = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(src), str(dst)])
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - t0
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0:
            print(f"conversion failed with status {child.returncode}", file=sys.stderr)
            return 1
        record = {
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True, cwd=Path(__file__).parent).stdout.strip(),
            "cpus": os.cpu_count(),
            "source": f"7B-shaped synthetic, {args.dtype}, {args.shards} shards",
            "source_gb": round(src_bytes / 1e9, 3),
            "output_gb": round(dst.stat().st_size / 1e9, 3),
            "generate_s": round(gen_s, 1),
            "convert_s": round(wall, 1),
            "source_mb_per_s": round(src_bytes / 1e6 / wall, 1),
            "peak_rss_gb": round(usage.ru_maxrss * 1024 / 1e9, 3),  # ru_maxrss is in KiB on Linux
        }
        print(json.dumps(record))
        print(f"| {record['date']} | {record['commit']} | {record['cpus']} CPUs | {record['source']} | "
              f"{record['source_gb']} GB -> {record['output_gb']} GB | {record['convert_s']} s | "
              f"{record['source_mb_per_s']} MB/s | {record['peak_rss_gb']} GB |")
        return 0
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
