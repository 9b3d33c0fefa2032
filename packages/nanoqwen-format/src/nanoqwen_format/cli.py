"""`nanoqwen-convert SRC -o OUT.nanoqwen` and `nanoqwen-convert inspect FILE [--json] [--verify]`.

The click commands `convert_command` and `inspect_command` are importable so nanoqwen-cli can mount them
as its own `convert` and `inspect`. A NanoqwenFormatError becomes one line on stderr and exit status 1.
"""

import json
from pathlib import Path

import click

from .errors import NanoqwenFormatError
from .quantize import DEFAULT_METHOD, METHODS
from .strict import is_finite_number, short


class _Error(click.ClickException):
    """One line on stderr, `error: <what>` naming the file: the style nanoqwen-cli uses for every error."""

    def show(self, file=None):
        click.echo(f"error: {self.format_message()}", file=file, err=file is None)


def _fail(e: NanoqwenFormatError, where):
    text = " ".join(str(e).split("\n"))
    return _Error(text if str(where) in text else f"{where}: {text}")


@click.command("convert")
@click.argument("src")
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="the .nanoqwen file to write")
@click.option("--force", is_flag=True, help="overwrite OUT if it exists")
@click.option("--quiet", is_flag=True, help="no progress bar or error table")
@click.option("--quantizer", type=click.Choice(METHODS), default=DEFAULT_METHOD, show_default=True,
              help="INT4 encoder (same file format; docs/QUANT.md compares them)")
def convert_command(src: str, out: Path, force: bool, quiet: bool, quantizer: str):
    """Convert SRC (a Hugging Face Qwen2ForCausalLM folder or hub id, or a qwen2 .gguf file) to one .nanoqwen
    file."""
    from .converter import convert
    if out.exists() and not force:
        raise _Error(f"{out} exists (use --force to overwrite)")
    try:
        summary = convert(src, out, progress=not quiet, quantizer=quantizer)
    except NanoqwenFormatError as e:
        raise _fail(e, src) from None
    click.echo(f"wrote {summary['path']} ({summary['bytes'] / 1e9:.3f} GB)")


def describe(model) -> dict:
    """The header as inspect shows it: the tokenizer's text replaced by its size."""
    head = {k: v for k, v in model.header.items() if k != "tokenizer_json"}
    head["tokenizer_json_chars"] = len(model.tokenizer_json)
    head["file_bytes"] = model.path.stat().st_size
    return head


@click.command("inspect")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="print the header as JSON (tokenizer text left out)")
@click.option("--verify", is_flag=True, help="also check every tensor's CRC32")
def inspect_command(file: Path, as_json: bool, verify: bool):
    """Validate a .nanoqwen FILE and print what it holds."""
    from .reader import open_model
    try:
        with open_model(file, verify=verify) as m:
            head = describe(m)
    except NanoqwenFormatError as e:
        raise _fail(e, file) from None
    if as_json:
        click.echo(json.dumps(head, indent=2))
        return
    click.echo(f"{file}: " + "\n".join(summary_lines(head, verify)))


def _text(v) -> str:
    """An informative value (provenance, architectures: any JSON) as short text."""
    if isinstance(v, str):
        return v if len(v) <= 100 else v[:97] + "..."
    if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
        return _text(", ".join(v))
    return short(v)


def summary_lines(head: dict, verify: bool) -> list[str]:
    """The text `inspect` prints for a validated file's header (describe()'s dict). The reader has checked
    what it uses; architectures and provenance are informative and may hold any JSON, so they go
    through _text."""
    c, tensors = head["config"], head["tensors"]
    by_dtype: dict[str, int] = {}
    for t in tensors:
        by_dtype[t["dtype"]] = by_dtype.get(t["dtype"], 0) + t["nbytes"]
    lines = [f".nanoqwen v1, {head['file_bytes'] / 1e9:.3f} GB, valid" + (", CRCs verified" if verify else "")]
    lines.append(f"  model      {_text(c.get('architectures') or '?')}: {c['num_hidden_layers']} layers, "
                 f"hidden {c['hidden_size']}, intermediate {c['intermediate_size']}, heads "
                 f"{c['num_attention_heads']}/{c['num_key_value_heads']} kv, vocab {c['vocab_size']}, "
                 f"tied {str(c['tie_word_embeddings']).lower()}, rope_theta {c['rope_theta']}, eps {c['rms_norm_eps']:g}")
    q = head["quantization"]
    lines.append(f"  quant      int{q['bits']} symmetric, group {q['group_size']}, {q['scale_dtype']} scales, {q['packing']}")
    lines.append(f"  tensors    {len(tensors)}: " + ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in sorted(by_dtype.items())))
    lines.append(f"  tokenizer  {head['tokenizer_json_chars']} chars; chat template "
                 f"{'yes' if head['tokenizer_config'].get('chat_template') else 'no'}; "
                 f"eos {head['generation_config'].get('eos_token_id', c.get('eos_token_id'))}")
    prov = head["provenance"]
    lines.append(f"  provenance {_text(prov.get('source', '?'))} by {_text(prov.get('converter', '?'))}"
                 + (f" at {_text(prov['created'])}" if "created" in prov else ""))
    gguf = prov.get("gguf")
    if prov.get("source_format") == "gguf" and isinstance(gguf, dict) and isinstance(gguf.get("tensor_types"), dict):
        types = ", ".join(f"{_text(k)} x{_text(n)}" for k, n in gguf["tensor_types"].items())
        lines.append(f"  source     GGUF ({types}): weights quantized twice, by the GGUF's types and then INT4")
    errors = prov.get("quantization_error")
    for kind, e in (errors.items() if isinstance(errors, dict) else ()):
        if isinstance(e, dict) and all(is_finite_number(e.get(k)) for k in ("max_abs", "mean_abs")):
            lines.append(f"    {_text(kind):<10} |w - w'| max {e['max_abs']:.3e} mean {e['mean_abs']:.3e}")
    return lines


class _ConvertGroup(click.Group):
    """`nanoqwen-convert SRC -o OUT` converts; `nanoqwen-convert inspect FILE` inspects."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["convert", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_ConvertGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """Convert a Hugging Face Qwen2 model or a qwen2 GGUF to .nanoqwen (SRC -o OUT), or inspect a .nanoqwen
    file."""


main.add_command(convert_command)
main.add_command(inspect_command)
