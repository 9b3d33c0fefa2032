"""Batched decode throughput of the CUDA backend (issue 13's protocol), driven at the backend level.

For each batch size B: B requests arrive at once, each a prompt of --prompt random token ids and
--gen generated tokens (greedy, no eos: every request produces exactly --gen tokens). The prompts are
prefilled in groups of --prefill-tokens tokens (default 512, the engine's per-step budget: 4 prompts of
128 per prefill_many call; each call returns its requests' first tokens: their time to first token is
measured from the arrival of all B), then every decode step feeds all B sequences at once until each
has --gen tokens. Reported per B:

    decode_tok_s      B x (gen - 1) / the decode steps' total time (the aggregate throughput)
    e2e_tok_s         B x gen / (prefills + decode steps)
    step_ms_mean      one decode step (every running sequence gets one token per step, so the step
    itl_ms p50/p99    times are also each sequence's inter-token latencies)
    ttft_ms p50/max   time to first token over the B requests

Each B first runs a short warm-up (its bucket's graph is captured on its second use, decode.py), so the
timed steps are graph replays. Timings are host wall-clock around calls that end with the device->host
read of the sampled ids, i.e. what a caller of the backend sees. Each call passes run_ahead as the
engine's scheduler does in a steady batch (every step but the last: the backend launches the next step
before returning, so the host's work overlaps it); --no-run-ahead measures the step-by-step path.

    python3 scripts/bench_batch.py MODEL.nanoqwen [--batch 1,8,32,64] [--prompt 128] [--gen 256] [--json out.json]

The INT4 GEMV variant is the engine's: $NANOQWEN_GEMV_VARIANT (nanoqwen_kernels.gemv.GEMV_VARIANTS, e.g.
NANOQWEN_GEMV_VARIANT=default), printed in the header and recorded in the JSON.

Needs a GPU (CuPy). Run by scripts/gpu_all.sh (section `batchbench`, on the 7B-shaped synthetic model).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

TARGETS = {1: "<= 2.1 ms/token", 8: ">= 3000 tok/s", 32: ">= 8000 tok/s", 64: ">= 12000 tok/s"}  # issue 13


def run_batch(be, B: int, prompt: int, gen: int, rng, greedy, run_ahead: bool = True,
              prefill_tokens: int = 512) -> dict:
    from nanoqwen_engine.sampler import SamplerState

    V = be.config.vocab
    prompts = [rng.integers(0, V, size=prompt).astype(np.int32) for _ in range(B)]
    seqs = [be.pool.new_sequence() for _ in range(B)]
    samplers = [SamplerState(greedy, V) for _ in range(B)]
    t0 = time.perf_counter()
    ttft, toks = [], []
    group = max(1, prefill_tokens // max(prompt, 1))  # prompts per prefill_many call (a step's budget)
    for g in range(0, B, group):
        items = list(zip(seqs[g:g + group], prompts[g:g + group], samplers[g:g + group], strict=True))
        toks += be.prefill_many(items) if group > 1 else [be.prefill(*items[0])]
        ttft += [time.perf_counter() - t0] * len(items)
    t_prefill = time.perf_counter() - t0
    steps = []
    for i in range(gen - 1):
        t = time.perf_counter()
        # run_ahead as the engine's scheduler passes it: every step but the last (the caller knows)
        toks = be.decode(seqs, toks, samplers, run_ahead=run_ahead and i < gen - 2)
        steps.append(time.perf_counter() - t)
    for s in seqs:
        be.pool.free(s)
    st_ms = np.array(steps) * 1e3
    dec = float(np.sum(steps))
    return {
        "batch": B,
        "prompt_tokens": prompt,
        "gen_tokens": gen,
        "decode_tok_s": B * (gen - 1) / dec,
        "e2e_tok_s": B * gen / (t_prefill + dec),
        "step_ms_mean": float(st_ms.mean()),
        "itl_ms_p50": float(np.percentile(st_ms, 50)),
        "itl_ms_p99": float(np.percentile(st_ms, 99)),
        "ttft_ms_p50": float(np.percentile(ttft, 50) * 1e3),
        "ttft_ms_max": float(max(ttft) * 1e3),
        "prefill_s_total": t_prefill,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--batch", default="1,8,32,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--json", default=None)
    ap.add_argument("--prefill-tokens", type=int, default=512,
                    help="prompt tokens per prefill_many call, as the engine's per-step budget (prefill_chunk, "
                         "default 512: 4 prompts of 128); at most one prompt per call when below --prompt")
    ap.add_argument("--no-run-ahead", action="store_true",
                    help="every step waits for the caller (no step launched ahead: Backend.decode run_ahead)")
    args = ap.parse_args()
    ahead = not args.no_run_ahead
    batches = [int(b) for b in args.batch.split(",")]

    from nanoqwen_engine import Engine
    from nanoqwen_engine.kv_pages import pages_for
    from nanoqwen_engine.params import SamplingParams
    from nanoqwen_kernels.gemv import DEFAULT_GEMV_VARIANT

    ctx = args.prompt + args.gen
    n_pages = max(batches) * pages_for(ctx) + 16
    t = time.perf_counter()
    eng = Engine.load(args.model, device="cuda", max_context=ctx + 16, kv_pages=n_pages, progress=False)
    load_s = time.perf_counter() - t
    be = eng.backend
    greedy = SamplingParams(temperature=0.0).resolve({})
    rng = np.random.default_rng(0)
    results = []
    variant = os.environ.get("NANOQWEN_GEMV_VARIANT") or DEFAULT_GEMV_VARIANT
    print(f"batched decode, {be.info.get('device')}, prompt {args.prompt} + {args.gen} generated, greedy, "
          f"GEMV variant {variant}, run ahead {'on' if ahead else 'off'}")
    print(f"{'B':>3s} {'decode tok/s':>12s} {'e2e tok/s':>10s} {'step ms p50':>11s} {'itl p99 ms':>10s} "
          f"{'ttft p50 ms':>11s} {'ttft max ms':>11s}  target")
    for B in batches:
        run_batch(be, B, 16, 4, rng, greedy, ahead, args.prefill_tokens)  # warm-up: eager step, capture
        r = run_batch(be, B, args.prompt, args.gen, rng, greedy, ahead, args.prefill_tokens)
        results.append(r)
        print(f"{B:3d} {r['decode_tok_s']:12.0f} {r['e2e_tok_s']:10.0f} {r['itl_ms_p50']:11.3f} "
              f"{r['itl_ms_p99']:10.3f} {r['ttft_ms_p50']:11.1f} {r['ttft_ms_max']:11.1f}  {TARGETS.get(B, '')}",
              flush=True)
    if args.json:
        # $NQ_COMMIT first: on the GPU machine the checkout's git metadata can lag the tree that was copied
        commit = os.environ.get("NQ_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump({"gpu_name": be.info.get("device"), "date": time.strftime("%Y-%m-%d"), "model": args.model,
                       "commit": commit or None, "gemv_variant": variant, "run_ahead": ahead, "prefill_tokens": args.prefill_tokens, "load_s": load_s, "max_batch": be.info.get("max_batch"),
                       "graph_kernel_nodes": {k: v for k, v in be.info.items() if k.startswith("graph_kernel")},
                       "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
