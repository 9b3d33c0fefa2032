"""The peer of nanoqwen's decode figures (docs/PERF.md): Hugging Face transformers on the same GPU, the same
model shape, the same protocol.

Builds Qwen2ForCausalLM from the shipped Qwen2.5-Coder-7B-Instruct config with random bf16 weights (no
download), then runs the decode protocol (docs/PERF.md, Method): a 512-token prompt, 128 new tokens,
greedy, eager PyTorch (no torch.compile), several timed runs after a warm-up, medians reported. Prints
one JSON record (and writes it to --out).

    python3 scripts/peer_transformers.py --out docs/perf/peer-transformers.json
    python3 scripts/peer_transformers.py --prefill-lengths 512,2048,8192,32768   # prefill only (issue 16)

--prefill-lengths: the prefill peer instead: one forward pass of a prompt of each length (logits of the last
position only, as nanoqwen's prefill computes them), attention as transformers chooses it (sdpa), medians.

Needs torch + transformers (on the GPU machine here; never a dependency of nanoqwen).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / (
    "packages/nanoqwen-format/src/nanoqwen_format/data/qwen2.5-coder-7b-instruct/config.json"
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--prefill-lengths", default=None, help="comma-separated prompt lengths: prefill only")
    args = ap.parse_args()

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if not torch.cuda.is_available():
        print("error: no CUDA GPU visible to torch", file=sys.stderr)
        return 2
    cfg = Qwen2Config(**json.loads(CONFIG.read_text()))
    torch.manual_seed(0)
    t0 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg)
    model.eval()
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0

    gen = torch.Generator(device="cuda").manual_seed(1)
    if args.prefill_lengths:
        return prefill_only(model, args, [int(v) for v in args.prefill_lengths.split(",")], gen, load_s)
    ids = torch.randint(0, 150000, (1, args.prompt_tokens), device="cuda", generator=gen)

    def timed(fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t, out

    prefill_ms, decode_ms = [], []
    with torch.inference_mode():
        for run in range(args.runs + 1):  # run 0 is the warm-up
            p_s, _ = timed(lambda: model(ids, use_cache=True))
            g_s, out = timed(
                lambda: model.generate(
                    ids,
                    max_new_tokens=args.new_tokens,
                    min_new_tokens=args.new_tokens,
                    do_sample=False,
                    pad_token_id=cfg.eos_token_id,
                )
            )
            assert out.shape[1] == args.prompt_tokens + args.new_tokens
            if run:
                prefill_ms.append(p_s * 1e3)
                # generate() = one prefill (-> first token) + (new_tokens - 1) decode steps.
                decode_ms.append((g_s - p_s) * 1e3 / (args.new_tokens - 1))

    rec = {
        "engine": "transformers",
        "transformers_version": __import__("transformers").__version__,
        "torch_version": torch.__version__,
        "gpu_name": torch.cuda.get_device_name(),
        "dtype": "bfloat16",
        "mode": "eager",
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "runs": args.runs,
        "prefill_ms": statistics.median(prefill_ms),
        "decode_ms_per_token": statistics.median(decode_ms),
        "decode_tok_s": 1e3 / statistics.median(decode_ms),
        "load_s": load_s,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(),
        "date": time.strftime("%Y-%m-%d"),
    }
    return emit(rec, args.out)


def emit(rec: dict, out: Path | None) -> int:
    """Print the record as JSON and write it to `out` when given."""
    text = json.dumps(rec, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return 0


def prefill_only(model, args, lengths, gen, load_s) -> int:
    """Median ms of one forward pass (a fresh KV cache each time) per prompt length."""
    import torch

    rec = {"engine": "transformers", "transformers_version": __import__("transformers").__version__,
           "torch_version": torch.__version__, "gpu_name": torch.cuda.get_device_name(), "dtype": "bfloat16",
           "attn_implementation": getattr(model.config, "_attn_implementation", None), "runs": args.runs,
           "load_s": load_s, "prefill_ms": {}, "date": time.strftime("%Y-%m-%d")}
    with torch.inference_mode():
        for n in lengths:
            ids = torch.randint(0, 150000, (1, n), device="cuda", generator=gen)
            times = []
            for run in range(args.runs + 1):  # run 0 is the warm-up
                torch.cuda.synchronize()
                t = time.perf_counter()
                model(ids, use_cache=True, logits_to_keep=1)
                torch.cuda.synchronize()
                if run:
                    times.append((time.perf_counter() - t) * 1e3)
            rec["prefill_ms"][n] = statistics.median(times)
            print(f"transformers prefill {n} tokens: {rec['prefill_ms'][n]:.1f} ms", flush=True)
    rec["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    return emit(rec, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
