"""`nanoqwen-cli verify`: greedy decoding on a device checked token by token against the CPU reference.

The graph tier of the validation ladder (DESIGN.md), at the CLI: for each prompt, both engines decode
greedily; a divergence is explained when the reference's own top-2 logits at that step are within EPS
(a near-tie that rounding may flip), and is a failure otherwise. score() logits of the two engines on
the same token sequence are compared too, as a relative error.
"""

from __future__ import annotations

import json

import click
import numpy as np

from nanoqwen_cli import session
from nanoqwen_cli.options import model_options
from nanoqwen_cli.verify_prompts import CHAT, prompt_set

DEFAULT_EPS = 0.1  # logit units; see the --eps help


@click.command(short_help="Greedy tokens vs the CPU reference.")
@model_options
@click.option(
    "--prompts",
    "n_prompts",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="How many prompts of the built-in set to run.",
)
@click.option(
    "--max-tokens",
    "-n",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Greedy tokens per prompt.",
)
@click.option(
    "--eps",
    type=click.FloatRange(min=0.0),
    default=DEFAULT_EPS,
    show_default=True,
    help="A divergence where the reference's top-2 logits differ by at most EPS is a near-tie (fp16 vs "
    "fp32 rounding can flip it) and passes; a larger margin fails.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON record instead of the table.")
def verify(model, device, max_context, n_prompts, max_tokens, eps, as_json):
    """Check greedy generation on --device against the CPU reference backend on the same model.

    For each prompt: matching tokens, the first divergence and the reference's top-2 logit margin there,
    and the relative error of score() logits. Exits 1 when any divergence is not at a near-tie (see --eps).
    With --device cpu the reference is checked against a second copy of itself (a plumbing smoke test).

    \b
    Examples:
        nanoqwen-cli verify --model model.nanoqwen --prompts 16 --max-tokens 64
        nanoqwen-cli verify --device cpu --model tiny.nanoqwen --prompts 4 --json
    """
    progress = not as_json
    under_test = session.load(model, device, max_context, progress=progress)
    reference = session.load(str(under_test.path), "cpu", max_context, progress=progress)
    rows = [
        _check(under_test.engine, reference.engine, kind, text, max_tokens, eps)
        for kind, text in prompt_set(n_prompts)
    ]
    failures = sum(r["verdict"] == "FAIL" for r in rows)
    record = {
        "model": under_test.model,
        "model_path": str(under_test.path),
        "device": device,
        "reference": "cpu",
        "max_tokens": max_tokens,
        "eps": eps,
        "prompts": len(rows),
        "identical": sum(r["verdict"] == "identical" for r in rows),
        "near_ties": sum(r["verdict"] == "near-tie" for r in rows),
        "failures": failures,
        "max_logit_rel_err": max(r["logit_rel_err"] for r in rows),
        "results": rows,
    }
    click.echo(json.dumps(record) if as_json else _table(record))
    if failures:
        raise click.exceptions.Exit(1)


def _check(engine, reference, kind: str, text: str, max_tokens: int, eps: float) -> dict:
    from nanoqwen_engine import SamplingParams

    request = session.messages_for(text, None) if kind == CHAT else text
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    _, got = session.complete(engine, request, params)
    _, want = session.complete(reference, request, params)
    a, b = got.token_ids, want.token_ids
    match = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    diverged = match < max(len(a), len(b))

    prompt_ids = _prompt_ids(reference, request)
    margin = None
    if diverged:
        # The reference's confidence at the step where the two disagree: logits after prompt + b[:match].
        logits = np.asarray(
            reference.score(np.asarray(prompt_ids + b[:match], dtype=np.int32))[-1], np.float64
        )
        top2 = np.partition(logits, -2)[-2:]
        margin = float(top2[1] - top2[0])
    seq = np.asarray(prompt_ids + b, dtype=np.int32)
    la = np.asarray(engine.score(seq), np.float64)
    lb = np.asarray(reference.score(seq), np.float64)
    rel = float(np.max(np.abs(la - lb)) / max(np.max(np.abs(lb)), 1e-30))

    verdict = "identical" if not diverged else ("near-tie" if margin <= eps else "FAIL")
    return {
        "kind": kind,
        "prompt": text,
        "prompt_tokens": len(prompt_ids),
        "tokens": len(b),
        "matching": match,
        "first_divergence": match if diverged else None,
        "ref_top2_margin": margin,
        "logit_rel_err": rel,
        "verdict": verdict,
    }


def _prompt_ids(engine, request) -> list[int]:
    """The token ids the engine itself prefills for `request` (chat template applied for messages)."""
    return [int(t) for t in engine.encode_prompt(request)]


def _table(r: dict) -> str:
    head = (
        f"{'#':>3}  {'kind':4}  {'prompt':32}  {'match':>9}  {'first div':>9}  {'ref margin':>10}  "
        f"{'logit rel':>9}  verdict"
    )
    lines = [
        f"verify {r['model']} on {r['device']} against the CPU reference, greedy {r['max_tokens']} tokens, "
        f"eps {r['eps']}",
        head,
        "-" * len(head),
    ]
    for i, x in enumerate(r["results"], 1):
        snippet = x["prompt"].replace("\n", " ")
        snippet = snippet if len(snippet) <= 32 else snippet[:29] + "..."
        div = "-" if x["first_divergence"] is None else str(x["first_divergence"])
        margin = "-" if x["ref_top2_margin"] is None else f"{x['ref_top2_margin']:.4f}"
        lines.append(
            f"{i:>3}  {x['kind']:4}  {snippet:32}  {x['matching']:>4}/{x['tokens']:<4}  {div:>9}  "
            f"{margin:>10}  {x['logit_rel_err']:9.2e}  {x['verdict']}"
        )
    lines.append(
        f"{r['identical']}/{r['prompts']} identical, {r['near_ties']} near-tie divergences, "
        f"{r['failures']} failures; max score() logit relative error {r['max_logit_rel_err']:.2e}"
    )
    return "\n".join(lines)
