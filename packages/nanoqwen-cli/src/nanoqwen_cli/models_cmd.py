"""`nanoqwen-cli models`, `pull` and `rm`: the model cache ($NANOQWEN_CACHE), as ollama's list/pull/rm.

The cache itself (names, records, conversion, the Hugging Face download) is nanoqwen_engine.model_source;
these commands print it.
"""

from __future__ import annotations

import json
import time

import click

from nanoqwen_cli import session
from nanoqwen_cli.errors import CliError


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _ago(t: float | None, now: float) -> str:
    if t is None:
        return "-"
    s = max(now - t, 0)
    for unit, span in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if s >= span:
            n = int(s // span)
            return f"{n} {unit}{'s' if n > 1 else ''} ago"
    return "just now"


def _record(m) -> dict:
    return {
        "name": m.name,
        "path": str(m.path),
        "size_bytes": m.size,
        "source": m.source,
        "kind": m.kind,
        "quantization": m.quantization,
        "converted_at": m.converted_at,
        "last_used": m.last_used,
        "error": m.error,
    }


@click.command(short_help="List the models in the cache.")
@click.option("--json", "as_json", is_flag=True, help="One JSON list of records instead of the table.")
def models(as_json):
    """List the converted models in $NANOQWEN_CACHE (default ~/.cache/nanoqwen): name, size, source,
    quantization, last used. A NAME works as `--model NAME` and as `nanoqwen-cli rm NAME`.

    \b
    Examples:
        nanoqwen-cli models
        nanoqwen-cli models --json
    """
    from nanoqwen_engine import model_source as ms

    entries = ms.list_models()
    if as_json:
        click.echo(json.dumps([_record(m) for m in entries]))
        return
    cache = ms.cache_dir()
    if not entries:
        click.echo(
            f"no models in {cache} yet: `nanoqwen-cli pull Qwen/Qwen2.5-Coder-7B-Instruct` (or any hub id, "
            "or a local Hugging Face folder) adds one",
            err=True,
        )
        return
    now = time.time()
    rows = [("NAME", "SIZE", "SOURCE", "QUANTIZATION", "LAST USED")]
    for m in entries:
        quant = m.quantization or f"unreadable: {m.error}"
        rows.append((m.name, _size(m.size), m.source or "?", quant, _ago(m.last_used, now)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1])
    click.echo(f"cache: {cache}; Hugging Face downloads: {ms.hf_hub_cache()}", err=True)


@click.command(short_help="Download and convert a model into the cache, without running it.")
@click.argument("model")
@click.option("--force", is_flag=True, help="Convert again even when the cached model is up to date.")
@click.option(
    "--drop-download",
    is_flag=True,
    help="Afterwards, delete the download from the Hugging Face cache: the converted model does not need "
    "it (pulling a newer revision downloads it again).",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
def pull(model, force, drop_download, quiet):
    """Download MODEL (a hub id) and convert it into $NANOQWEN_CACHE, or convert a local Hugging Face
    folder, without loading it. A hub model already in the cache is converted again only when the hub
    has a newer revision (or with --force); `run` and `chat` never ask the hub for a cached model.

    \b
    Examples:
        nanoqwen-cli pull Qwen/Qwen2.5-Coder-7B-Instruct
        nanoqwen-cli pull Qwen/Qwen2.5-Coder-1.5B-Instruct --drop-download
        nanoqwen-cli pull ./my-qwen2-checkpoint
    """
    from nanoqwen_engine import model_source as ms

    r = ms.pull_model(model, progress=not quiet, force=force)
    verb = "converted" if r.converted else "cached"
    click.echo(f"{verb} {r.path.stem} ({_size(r.path.stat().st_size)}): {r.path}")
    if r.note:
        click.echo(r.note, err=True)
    if r.meta.get("kind") != "hub":
        if drop_download:
            click.echo(f"{model} is not a hub download: nothing to drop", err=True)
        return
    if drop_download:
        freed = ms.drop_download(r.meta["source"])
        click.echo(
            f"dropped the Hugging Face download of {r.meta['source']} ({_size(freed)} freed)", err=True
        )
    else:
        note = session.download_note(r.meta, "--drop-download removes it")
        if note:
            click.echo(note, err=True)


@click.command(short_help="Remove models from the cache.")
@click.argument("names", nargs=-1, required=True)
@click.option(
    "--drop-download", is_flag=True, help="Also delete a hub model's download from the Hugging Face cache."
)
def rm(names, drop_download):
    """Remove cached models by NAME (as `nanoqwen-cli models` lists them, or their hub id).

    \b
    Examples:
        nanoqwen-cli rm Qwen--Qwen2.5-Coder-7B-Instruct
        nanoqwen-cli rm Qwen/Qwen2.5-Coder-1.5B-Instruct --drop-download
    """
    from nanoqwen_engine import ModelNotFoundError
    from nanoqwen_engine import model_source as ms

    missing = []
    for name in names:
        try:
            gone = ms.remove_model(name)
        except ModelNotFoundError as e:
            missing.append(str(e))
            continue
        click.echo(f"removed {gone.name} ({_size(gone.size)})")
        if drop_download and gone.kind == "hub" and gone.source:
            freed = ms.drop_download(gone.source)
            click.echo(f"dropped the Hugging Face download of {gone.source} ({_size(freed)} freed)", err=True)
    if missing:
        raise CliError("; ".join(missing))
