"""`nanoqwen-cli verify`: greedy decoding on a device checked token by token against the CPU reference.

The graph tier of the validation ladder (docs/VALIDATION.md) at the command line. The ladder itself (the prompt
set, the greedy comparison, the near-tie rule and its calibrated epsilon) lives in
`nanoqwen_engine.validation`, shared with the ladder tests; this command loads the two engines, adds the
score() logit error, prints, and sets the exit status.
"""

from __future__ import annotations

import json

import click

from nanoqwen_cli import session
from nanoqwen_cli.options import count_option, decode_activations_option, lm_head_dtype_option, model_options


def _default_eps(engine) -> float:
    """The near-tie bound of the engine under test: its decode activations' (validation.EPS)."""
    from nanoqwen_engine.validation import eps_for

    return eps_for(engine)


@click.command(short_help="Greedy tokens vs the CPU reference.")
@model_options
@lm_head_dtype_option
@decode_activations_option
@count_option(
    "--prompts",
    "n_prompts",
    default=8,
    help="How many prompts of the built-in diverse set (code, prose, chat, page-boundary lengths).",
)
@count_option("--max-tokens", "-n", default=32, help="Greedy tokens per prompt.")
@count_option("--max-prompt-tokens", default=512, help="Longest prompt of the set, in tokens.")
@click.option(
    "--eps",
    type=click.FloatRange(min=0.0),
    default=None,
    help="A divergence passes as a near-tie when the reference prefers its own token over the other "
    "engine's by at most EPS logits (rounding can flip that); more fails. Default: "
    "nanoqwen_engine.validation.EPS of the device's decode activations, ~6 sigma of its rounding noise "
    "on random-weight models: 0.1 for fp16 (and --device cpu), 0.7 for int8 (the GPU's default).",
)
@count_option(
    "--score-prompts",
    default=4,
    lo=0,
    help="On this many prompts, also compare score() logits over prompt + reference tokens.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON record instead of the table.")
def verify(
    model,
    device,
    max_context,
    lm_head_dtype,
    decode_activations,
    n_prompts,
    max_tokens,
    max_prompt_tokens,
    eps,
    score_prompts,
    as_json,
):
    """Check greedy generation on --device against the CPU reference backend on the same model.

    Both engines decode each prompt greedily. Reported: matching tokens, the first divergence, the
    reference's top-2 margin and its gap between the two engines' tokens there, and (on --score-prompts
    prompts) the relative error of score() logits. Exits 1 when a divergence is not a near-tie (--eps).
    With --device cpu the reference is checked against a second copy of itself (a plumbing smoke test).
    The CPU reference of a 7B model costs seconds per token: start small (--prompts 2 --max-tokens 8).

    \b
    Examples:
        nanoqwen-cli verify --model qwen7b.nanoqwen --prompts 16 --max-tokens 64
        nanoqwen-cli verify --device cpu --model tiny.nanoqwen --prompts 4 --json
    """
    from nanoqwen_engine.validation import build_prompts, compare_greedy, format_report, logit_error

    if device == "cuda":
        session.require_gpu()  # before minutes of loading the reference
    progress = not as_json
    # --lm-head-dtype goes to both engines: the reference multiplies the values the device does
    reference = session.load(model, "cpu", max_context, progress=progress, lm_head_dtype=lm_head_dtype)
    b = reference.engine
    limit = b.max_context - max_tokens  # longest prompt that leaves room for the answer
    if limit < 1:
        raise click.UsageError(
            f"a context of {b.max_context} tokens leaves no room for --max-tokens {max_tokens}"
        )
    prompts = build_prompts(b.tokenizer, n=n_prompts, max_tokens=min(max_prompt_tokens, limit))
    lengths = [len(b.encode_prompt(p.payload)) for p in prompts]
    skipped = [p.name for p, n in zip(prompts, lengths, strict=True) if n > limit]
    prompts = [p for p, n in zip(prompts, lengths, strict=True) if n <= limit]
    if not prompts:
        raise click.UsageError(f"no prompt of the set fits a context of {b.max_context} tokens")
    needed = max(n for n in lengths if n <= limit) + max_tokens
    under_test = session.load(str(reference.path), device, max_context or needed, progress=progress,
                              lm_head_dtype=lm_head_dtype, decode_activations=decode_activations)
    under_test.model = reference.model
    a = under_test.engine
    eps = _default_eps(a) if eps is None else eps
    if skipped and progress:
        click.echo(
            f"skipped {len(skipped)} prompts longer than {limit} tokens: {', '.join(skipped)}", err=True
        )

    def tick(i, result):
        if progress:
            verdict = "identical" if result.divergence is None else ("near-tie" if result.ok else "BUG")
            click.echo(
                f"[{i + 1}/{len(prompts)}] {result.name}: {result.matched} matching, {verdict}", err=True
            )

    report = compare_greedy(a, b, prompts, max_tokens=max_tokens, eps=eps, progress=tick)
    errors = []
    for r, p in list(zip(report.results, prompts, strict=True))[:score_prompts]:
        seq = b.encode_prompt(p.payload) + r.tokens_b
        errors.append({"prompt": r.name, **logit_error(a.score(seq), b.score(seq))})

    record = {
        "model": under_test.model,
        "model_path": str(under_test.path),
        "device": device,
        "reference": "cpu",
        "skipped_prompts": skipped,
        **report.as_dict(),
        "score": errors,
        "max_logit_rel_err": max((e["rel"] for e in errors), default=None),
    }
    if as_json:
        click.echo(json.dumps(record))
    else:
        click.echo(f"verify {under_test.model} on {device} against the CPU reference: greedy, eps {eps}")
        click.echo(format_report(report))
        for e in errors:
            click.echo(
                f"score() {e['prompt']}: relative error {e['rel']:.2e}, max |diff| {e['max_abs']:.3e}, "
                f"argmax agreement {100 * e['argmax_agree']:.1f}%"
            )
    if not report.ok:
        raise click.exceptions.Exit(1)
