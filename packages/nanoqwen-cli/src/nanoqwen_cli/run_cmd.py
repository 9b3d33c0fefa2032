"""`nanoqwen-cli run`: one prompt in, the answer streamed out as it is generated."""

from __future__ import annotations

import json
import sys

import click

from nanoqwen_cli import session
from nanoqwen_cli.errors import CliError
from nanoqwen_cli.options import (
    decode_activations_option,
    lm_head_dtype_option,
    model_options,
    sampling_options,
    sampling_overrides,
)


@click.command(short_help="Generate an answer to a prompt, streamed.")
@click.argument("prompt", required=False)
@model_options
@lm_head_dtype_option
@decode_activations_option
@sampling_options
@click.option(
    "--system", default=None, help="System message for the chat template (default: the model's own)."
)
@click.option(
    "--raw", is_flag=True, help="Plain completion of PROMPT, no chat template (code completion, FIM)."
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bars and no timing line on stderr.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON record (text, token counts, timings, finish_reason, model, device) at the end "
    "instead of streaming.",
)
def run(prompt, model, device, max_context, lm_head_dtype, decode_activations, system, raw, quiet, as_json,
        **sampling):
    """Generate an answer to PROMPT (an argument, or stdin when absent or `-`, less one trailing newline),
    streamed to stdout.

    Instruct models get the chat template (with --system if given); --raw completes the text as is.
    Sampling defaults come from the model's generation_config; any flag overrides one value. At the end,
    load time, prefill and decode tokens/s (and the seed, when sampling) go to stderr (--quiet to
    silence). On a terminal, a "processing prompt" line covers a slow prefill.

    \b
    Examples:
        nanoqwen-cli run "Write a quicksort in Rust."
        echo "def fib(n):" | nanoqwen-cli run --raw --temperature 0 --max-tokens 64
        nanoqwen-cli run --device cpu --model Qwen/Qwen2.5-Coder-1.5B-Instruct --json "hello"
    """
    params = session.make_params(sampling_overrides(sampling))  # bad values fail before a load
    text = _read_prompt(prompt)
    if raw and system is not None:
        raise click.UsageError("--system applies to the chat template; it has no meaning with --raw")
    request = text if raw else session.messages_for(text, system)

    loaded = session.load(model, device, max_context, progress=not (quiet or as_json),
                          lm_head_dtype=lm_head_dtype, decode_activations=decode_activations)
    engine = loaded.engine
    n_prompt = len(engine.encode_prompt(request))
    params, note = session.fit_max_tokens(engine, n_prompt, params)
    if note and not quiet:
        click.echo(note, err=True)

    if as_json:
        text, stats = session.complete(engine, request, params)
        click.echo(json.dumps(_record(loaded, text, stats)))
        return

    stats = session.Stats()
    out = sys.stdout
    for delta in session.stream(
        engine, request, params, stats, prompt_tokens=n_prompt, show_progress=not quiet
    ):
        # Flush per delta: a pipe would otherwise hold the answer back until the end.
        out.write(delta)
        out.flush()
    out.write("\n")
    out.flush()
    if not quiet:
        click.echo(
            session.format_stats(stats, load_s=loaded.load_s, show_seed=session.sampled(engine, params)),
            err=True,
        )


def _read_prompt(prompt: str | None) -> str:
    if prompt is None or prompt == "-":
        stdin = sys.stdin
        if prompt is None and stdin.isatty():
            raise click.UsageError("no prompt: give PROMPT as an argument or pipe it on stdin")
        prompt = stdin.read()
        # `echo ... |` ends the text with a newline the user did not mean as part of a raw completion.
        prompt = prompt[:-1] if prompt.endswith("\n") else prompt
    if not prompt.strip():
        raise CliError("the prompt is empty")
    return prompt


def _record(loaded: session.Loaded, text: str, stats: session.Stats) -> dict:
    return {
        "text": text,
        "finish_reason": stats.finish_reason,
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "token_ids": stats.token_ids,
        "load_s": loaded.load_s,
        "prefill_s": stats.prefill_s,
        "decode_s": stats.decode_s,
        "prefill_tok_s": _finite(stats.prefill_tok_s),
        "decode_tok_s": _finite(stats.decode_tok_s),
        "seed": stats.seed,
        "model": loaded.model,
        "model_path": str(loaded.path),
        "device": loaded.device,
    }


def _finite(x: float) -> float | None:
    return None if x != x else x  # NaN (no steps) is not valid JSON
