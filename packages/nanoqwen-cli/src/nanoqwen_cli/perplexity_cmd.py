"""`nanoqwen-cli perplexity`: the perplexity of a model on text files, the number engines and quantizations
are compared by (nanoqwen_engine.perplexity has the definition)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import click

from nanoqwen_cli import session
from nanoqwen_cli.errors import CliError
from nanoqwen_cli.options import lm_head_dtype_option, model_options


@click.command(short_help="Perplexity of a model on text files.")
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
@model_options
@lm_head_dtype_option
@click.option(
    "--window",
    type=int,
    default=1024,
    show_default=True,
    help="Tokens per window. Windows do not overlap; each is scored from an empty context.",
)
@click.option(
    "--max-windows",
    type=click.IntRange(min=1),
    default=None,
    help="Score only the first N windows (a quick estimate; llama-perplexity's --chunks).",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON record: ppl, nll_mean, nll_stderr, tokens_scored, windows, window, time_s, "
    "window_nll, model, device, files, tokens.",
)
def perplexity(files, model, device, max_context, lm_head_dtype, window, max_windows, quiet, as_json):
    """Perplexity of the model on FILES (UTF-8 text, tokenized one by one and joined in the order given).

    The joined tokens are cut into non-overlapping windows of --window tokens (a last, shorter window
    counts if it has 2 tokens or more). In each window every token but the first is predicted from the
    tokens before it in that window; the first is context only. The perplexity is exp of the mean negative
    log-likelihood over all predictions (token-weighted). llama.cpp's llama-perplexity scores only the
    second half of each window, so its numbers on the same text are lower: compare like with like.

    \b
    Examples:
        nanoqwen-cli perplexity --model qwen1.5b.nanoqwen /usr/lib/python3.11/functools.py
        nanoqwen-cli perplexity --device cpu --model tiny.nanoqwen --window 64 --json notes.txt
    """
    from nanoqwen_engine.perplexity import check_window, planned_tokens
    from nanoqwen_engine.perplexity import perplexity as measure

    if window < 2:
        raise CliError(f"--window must be at least 2 tokens, got {window}")
    texts = [_read_text(f) for f in files]  # every file is checked before the model loads
    loaded = session.load(model, device, max_context or window, progress=not (quiet or as_json),
                          lm_head_dtype=lm_head_dtype)
    engine = loaded.engine
    check_window(engine, window)
    ids: list[int] = []
    for text in texts:
        ids += engine.tokenizer.encode(text, parse_special=False)  # markup in a file is text, not control
    if len(ids) < 2:
        raise CliError(f"the text is {len(ids)} token(s); perplexity needs at least 2")

    bar = None
    if not quiet:
        from tqdm import tqdm

        bar = tqdm(total=planned_tokens(len(ids), window, max_windows), unit=" tok", desc="scoring",
                   file=sys.stderr, dynamic_ncols=True)

    def progress(n: int, ppl: float) -> None:
        if bar is not None:
            bar.update(n)
            bar.set_postfix(ppl=f"{ppl:.4f}")

    try:
        result = measure(engine, ids, window=window, max_windows=max_windows, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    if as_json:
        record = {**result.as_dict(), "model": str(loaded.path), "device": device,
                  "files": [str(f) for f in files], "tokens": len(ids)}
        click.echo(json.dumps(record))
        return
    se = result.nll_stderr
    band = f" +/- {result.ppl * se:.4f}" if math.isfinite(se) else ""
    click.echo(f"perplexity {result.ppl:.4f}{band} | {result.tokens_scored} tokens scored in {result.windows} "
               f"window(s) of {window} | nll mean {result.nll_mean:.4f} | {result.seconds:.1f} s")


def _read_text(path: Path) -> str:
    if not path.exists():
        raise CliError(f"file not found: {path}")
    if path.is_dir():
        raise CliError(f"is a directory, expected a text file: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CliError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise CliError(f"{path}: the file is empty")
    return text
