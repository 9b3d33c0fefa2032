"""Ladder tier 3: whole generations through the GPU engine (CUDA-graph decode) against the CPU reference.

tiny model: NANOQWEN_LADDER_PROMPTS (default 100) prompts of build_prompts (code in 8 languages, prose,
chat and raw, 1..2000 tokens, page-boundary lengths 15/16/17/31/32/33), greedy, NANOQWEN_LADDER_TOKENS
(default 64) tokens each; plus score() logits GPU vs CPU.
7B-shaped model: the CPU reference needs seconds per token there, so NANOQWEN_LADDER_7B_PROMPTS (default 3)
short prompts x NANOQWEN_LADDER_7B_TOKENS (default 8) tokens, and score() on 33 tokens.

A divergence passes only at a near-tie: the reference's logit gap between its token and the GPU's token
there <= eps (nanoqwen_engine.validation.EPS of the engine's decode activations, why in its module doc).
The tiny tier runs both decode activations against the same reference tokens: int8 (the default) at its
eps, fp16 at the tighter 0.1, so the plumbing both share is still judged at fp16's resolution. Reports are written as JSON
under $NANOQWEN_LADDER_OUT when set (scripts/gpu_all.sh sets it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from ladder.engines import cpu_engine, gpu_engine
from nanoqwen_engine import Engine, SamplingParams
from nanoqwen_engine.validation import (
    build_prompts,
    compare_greedy,
    eps_for,
    format_report,
    logit_error,
    reference_tokens_parallel,
)

pytestmark = pytest.mark.gpu

SCORE_BOUND = 2e-2  # relative Frobenius error of score() logits; ~1e-3 per layer of fp16 rounding


def _env(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _record(name: str, data: dict) -> None:
    out = os.environ.get("NANOQWEN_LADDER_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(data, indent=1, default=float))


def _progress(i, r):
    tag = "ok" if r.divergence is None else ("near-tie" if r.ok else "BUG")
    print(f"  [{i:3d}] {r.name:36s} len {r.prompt_tokens:5d} match {r.matched:3d}/{len(r.tokens_b):3d} {tag}",
          flush=True)


def _check_tier(name, g, c, prompts, max_tokens, score_prompt, score_len, tokens_b=None) -> None:
    """Greedy tokens of `g` against the reference `c` on `prompts`, then score() logits of both on
    score_prompt + the first prompt's reference tokens (the first score_len ids); recorded under `name`
    before the asserts, so a failure's figures are kept."""
    rep = compare_greedy(g, c, prompts, max_tokens=max_tokens, eps=eps_for(g), progress=_progress,
                         tokens_b=tokens_b)
    ids = np.asarray(g.encode_prompt(score_prompt.payload) + rep.results[0].tokens_b)[:score_len]
    score = logit_error(g.score(ids), c.score(ids))
    score["tokens"] = len(ids)
    _record(name, {**rep.as_dict(), "score": score, "info": g.backend.info})
    print("\n" + format_report(rep) + f"\nscore(): {score}")
    assert rep.ok, format_report(rep)
    assert score["finite"] and score["rel"] < SCORE_BOUND


_REF_TOKENS: dict = {}  # (path, prompts, tokens) -> the reference's generations, shared by both activations


@pytest.mark.parametrize("activations", ["int8", "fp16"])
def test_graph_tier_tiny(gpu, ladder_tiny_path, activations):
    n, m = _env("NANOQWEN_LADDER_PROMPTS", 100), _env("NANOQWEN_LADDER_TOKENS", 64)
    ctx = 2048 + m + 64
    g = gpu_engine(ladder_tiny_path, max_context=ctx, decode_activations=activations)
    assert g.backend.info["decode_activations"] == activations
    c = cpu_engine(ladder_tiny_path, max_context=ctx)
    prompts = build_prompts(g.tokenizer, n=n)
    # the reference's generations from one process per core (it is the slow side), once for both
    workers = _env("NANOQWEN_LADDER_WORKERS", min(16, os.cpu_count() or 1))
    key = (str(ladder_tiny_path), n, m)
    if key not in _REF_TOKENS and workers > 1:
        _REF_TOKENS[key] = reference_tokens_parallel(ladder_tiny_path, prompts, m, ctx, workers)
    name = "graph_tiny" if activations == "int8" else "graph_tiny_fp16"
    _check_tier(name, g, c, prompts, m, prompts[min(8, n - 1)], 300, tokens_b=_REF_TOKENS.get(key))


def test_graph_and_eager_agree_tiny(gpu, ladder_tiny_path):
    """The eager-vs-graph comparison: the same launches, with and without the graph."""
    gr = gpu_engine(ladder_tiny_path, max_context=512)
    ea = gpu_engine(ladder_tiny_path, max_context=512, decode_mode="eager")
    p = SamplingParams(temperature=0, max_tokens=40)
    for prompt in ("def quicksort(xs):", "The capital of France is", "x" * 31):
        assert gr.complete(prompt, p).token_ids == ea.complete(prompt, p).token_ids
    assert gr.backend.step.graphs and not ea.backend.step.graphs


def test_graph_tier_7b(gpu, ladder_7b_path):
    n, m = _env("NANOQWEN_LADDER_7B_PROMPTS", 3), _env("NANOQWEN_LADDER_7B_TOKENS", 8)
    g = gpu_engine(ladder_7b_path, max_context=1024)
    c = cpu_engine(ladder_7b_path, max_context=1024)
    everything = build_prompts(g.tokenizer, n=40, max_tokens=64)
    # short ones: page-boundary lengths first, then a chat prompt
    short = [p for p in everything if p.kind == "boundary"] + [p for p in everything if p.kind == "chat"]
    prompts = short[:n]
    _check_tier("graph_7b", g, c, prompts, m, prompts[0], 33)


def test_engine_load_7b_streams(gpu, ladder_7b_path):
    """The public path: Engine.load(..., device="cuda").generate(...) streams tokens."""
    e = Engine.load(ladder_7b_path, device="cuda", max_context=4096, progress=False)
    events = list(e.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=24)))
    assert 1 <= len(events) <= 24 and events[-1].finish_reason in ("stop", "length")
    assert all(ev.finish_reason is None for ev in events[:-1])
    info = {k: v for k, v in e.info.items() if isinstance(v, int | float | str)}
    _record("engine_7b", {"info": info, "tokens": [ev.token_id for ev in events]})
    print(f"\n7B load: {info}")
    assert info["weights_bytes"] > 4e9


def test_decode_speed_7b_graph_vs_eager(gpu, ladder_7b_path):
    """The decode benchmark protocol (512-token prompt, 128 greedy tokens), graph and eager decode: a measurement
    recorded for docs/VALIDATION.md and issue 7, never a timing assertion; the two modes' tokens must be
    identical (the same launches, with and without the graph)."""
    from nanoqwen_engine.validation import corpus, text_of_length

    rec = {}
    tokens = {}
    for mode in ("graph", "eager"):
        e = gpu_engine(ladder_7b_path, max_context=1024, decode_mode=mode)
        prompt = text_of_length(e.tokenizer, corpus(), 512)
        p = SamplingParams(temperature=0, max_tokens=128)
        e.complete(prompt, SamplingParams(temperature=0, max_tokens=8))  # warm-up: first graph capture
        runs = [e.complete(prompt, p) for _ in range(3)]
        st = [r.stats for r in runs]
        per_tok = sorted(s["decode_s"] / max(1, s["generated_tokens"] - 1) for s in st)
        rec[mode] = {"prefill_ms": 1e3 * sorted(s["prefill_s"] for s in st)[1],
                     "decode_ms_per_token": 1e3 * per_tok[1], "generated_tokens": st[0]["generated_tokens"],
                     "launcher_calls_per_token": e.backend.info.get("launcher_calls_per_token"),
                     "graph_kernel_nodes": e.backend.info.get("graph_kernel_nodes_greedy")}
        tokens[mode] = runs[0].token_ids
        del e
    _record("speed_7b", rec)
    print(f"\n7B speed (512-token prompt, 128 tokens, median of 3): {rec}")
    assert tokens["graph"] == tokens["eager"]
