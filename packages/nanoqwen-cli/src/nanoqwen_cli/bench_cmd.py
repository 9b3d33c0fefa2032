"""`nanoqwen-cli bench`: the seed's decode/prefill protocol, with bandwidth napkin math.

Protocol (SEED.md, DESIGN.md "Performance"): a 512-token prompt, 128 generated tokens, greedy, one
warm-up run then several timed runs; the median run is reported. Decode speed is judged against the
bytes a token must read (bandwidth.py) and the copy bandwidth measured on the H200 here (4.19 TB/s).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
from pathlib import Path

import click

from nanoqwen_cli import bandwidth, session
from nanoqwen_cli.errors import CliError
from nanoqwen_cli.options import model_options

MEASURED_COPY_BW_GBS = 4190.0  # DESIGN.md: device-to-device copy on the H200 here, read + write

# Words that the Qwen2 tokenizer keeps as one token each after a space, so that N of them is N tokens
# whatever their order; the bench checks the count with the model's own tokenizer anyway.
_FILLER = (" the", " of", " and", " to", " in", " is", " that", " for", " it", " with", " as", " on")


@click.command(short_help="Prefill/decode speed, GB/s, peak memory.")
@model_options
@click.option(
    "--synthetic",
    type=click.Choice(["7b", "tiny"]),
    default=None,
    help="Bench a random model of this shape, written once into $NANOQWEN_CACHE (no download).",
)
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--gen-tokens", type=click.IntRange(min=2), default=128, show_default=True)
@click.option(
    "--runs", type=click.IntRange(min=1), default=5, show_default=True, help="Timed runs (median reported)."
)
@click.option(
    "--warmup", type=click.IntRange(min=0), default=1, show_default=True, help="Untimed runs first."
)
@click.option(
    "--eager", is_flag=True, help="Decode with eager kernel launches instead of the CUDA graph (cuda only)."
)
@click.option(
    "--copy-bw",
    type=click.FloatRange(min=0.0, min_open=True),
    default=MEASURED_COPY_BW_GBS,
    show_default=True,
    help="Copy bandwidth in GB/s that the achieved GB/s is compared with.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON record instead of the table.")
@click.pass_context
def bench(
    ctx,
    model,
    device,
    max_context,
    synthetic,
    prompt_tokens,
    gen_tokens,
    runs,
    warmup,
    eager,
    copy_bw,
    as_json,
):
    """Measure prefill and decode speed, achieved GB/s and peak memory.

    Decode GB/s counts the bytes each token reads (INT4 projections + scales + lm_head from the file's
    tensor table, + K/V at the mean context) over the measured ms/token, and compares with --copy-bw.

    \b
    Examples:
        nanoqwen-cli bench --synthetic 7b              # 7B-shaped random weights, no download
        nanoqwen-cli bench --synthetic 7b --eager --json
        nanoqwen-cli bench --device cpu --synthetic tiny --prompt-tokens 32 --gen-tokens 8 --runs 2
    """
    if eager and device != "cuda":
        raise click.UsageError(
            "--eager selects the GPU's no-graph decode; the CPU reference has no CUDA graphs"
        )
    engine_kwargs = {"decode_mode": "eager"} if eager else {}
    if device == "cuda":
        # Before writing a 5 GB synthetic model that could not be benched.
        session.require_gpu()
        session.check_engine_kwargs(**engine_kwargs)
    if synthetic is not None:
        if ctx.get_parameter_source("model") not in (click.core.ParameterSource.DEFAULT, None):
            raise click.UsageError("give either --model or --synthetic, not both")
        model = str(synthetic_model(synthetic, quiet=as_json))
    context_needed = prompt_tokens + gen_tokens
    if max_context is None:
        max_context = context_needed
    elif max_context < context_needed:
        raise click.UsageError(
            f"--max-context {max_context} is below prompt + generated = {context_needed} tokens"
        )

    loaded = session.load(model, device, max_context, progress=not as_json, **engine_kwargs)
    if synthetic is not None:
        loaded.model = f"synthetic {synthetic} (random weights, seed 0)"
    engine = loaded.engine
    prompt = bench_prompt(engine, prompt_tokens)
    # ignore_eos: the protocol times exactly gen_tokens decode steps, whatever the (random) model says.
    params = session.make_params(
        {"temperature": 0.0, "max_tokens": gen_tokens, "stop": None, "ignore_eos": True}
    )

    for _ in range(warmup):
        session.complete(engine, prompt, params)
    records = []
    for _ in range(runs):
        _, stats = session.complete(engine, prompt, params)
        records.append(_run_record(stats))

    result = _summary(loaded, records, prompt_tokens, gen_tokens, copy_bw, eager)
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo(_table(result))


def synthetic_model(name: str, quiet: bool) -> Path:
    """The cached random model of shape `name`; written once (atomically) and reused by later benches."""
    from nanoqwen_format.synthetic import qwen7b_config, tiny_config, write_synthetic

    path = session.cache_dir() / f"synthetic-{name}-seed0.nanoqwen"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not quiet:
            click.echo(f"writing a synthetic {name} model to {path} (once)", err=True)
        config = qwen7b_config() if name == "7b" else tiny_config()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            write_synthetic(tmp, config, seed=0)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def bench_prompt(engine, n_tokens: int) -> str:
    """A raw-completion prompt of exactly `n_tokens` tokens under the model's tokenizer."""
    text = "".join(_FILLER[i % len(_FILLER)] for i in range(n_tokens))
    got = len(engine.tokenizer.encode(text))
    if got != n_tokens:
        raise CliError(
            f"the bench prompt tokenizes to {got} tokens, not {n_tokens}; this tokenizer is unexpected"
        )
    return text


def _run_record(stats: session.Stats) -> dict:
    decode_steps = max(stats.generated_tokens - 1, 0)  # the first token comes out of the prefill
    return {
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "prefill_ms": stats.prefill_s * 1e3,
        "decode_ms_per_token": stats.decode_s * 1e3 / decode_steps if decode_steps else None,
        "finish_reason": stats.finish_reason,
    }


def _summary(loaded, records, prompt_tokens, gen_tokens, copy_bw, eager) -> dict:
    from nanoqwen_format import open_model

    prefill_ms = statistics.median(r["prefill_ms"] for r in records)
    per_token = [r["decode_ms_per_token"] for r in records if r["decode_ms_per_token"] is not None]
    decode_ms = statistics.median(per_token) if per_token else None
    with _opened(open_model(loaded.path)) as nq:
        counts = bandwidth.decode_bytes(nq)
    mean_context = prompt_tokens + gen_tokens / 2
    bytes_per_token = counts.at_context(mean_context)
    gbs = bytes_per_token / (decode_ms * 1e-3) / 1e9 if decode_ms else None
    info = dict(getattr(loaded.engine, "info", {}) or {})
    return {
        "model": loaded.model,
        "model_path": str(loaded.path),
        "device": loaded.device,
        "gpu_name": _gpu_name(info) if loaded.device == "cuda" else None,
        "mode": info.get("decode_mode", "eager" if eager else "graph")
        if loaded.device == "cuda"
        else "reference",
        "prompt_tokens": prompt_tokens,
        "gen_tokens": gen_tokens,
        "load_s": loaded.load_s,
        "prefill_ms": prefill_ms,
        "prefill_tok_s": prompt_tokens / (prefill_ms * 1e-3) if prefill_ms > 0 else None,
        "decode_ms_per_token": decode_ms,
        "decode_tok_s": 1e3 / decode_ms if decode_ms else None,
        "bytes_per_token": bytes_per_token,
        "weight_bytes_per_token": counts.projections + counts.scales + counts.lm_head,
        "kv_bytes_per_context_token": counts.kv_per_token,
        "mean_context": mean_context,
        "achieved_gbs": gbs,
        "copy_bw_gbs": copy_bw,
        "pct_of_copy_bw": 100.0 * gbs / copy_bw if gbs else None,
        "peak_gpu_mem_bytes": _peak_gpu_bytes(info) if loaded.device == "cuda" else None,
        "gpu_pool_bytes": _gpu_pool_bytes() if loaded.device == "cuda" else None,
        "peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "engine_info": {k: v for k, v in info.items() if isinstance(v, (int, float, str, bool, type(None)))},
        "runs": records,
    }


class _opened:
    """`with` for a NanoqwenFile whether or not it is a context manager itself."""

    def __init__(self, nq):
        self.nq = nq

    def __enter__(self):
        return self.nq

    def __exit__(self, *exc):
        close = getattr(self.nq, "close", None)
        if close is not None:
            close()


def _gpu_name(info: dict) -> str | None:
    for key in ("gpu_name", "device_name", "device"):
        if isinstance(info.get(key), str) and info[key] not in ("cuda", "cpu"):
            return info[key]
    try:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        return None


def _peak_gpu_bytes(info: dict) -> int | None:
    """The engine's own peak if it reports one, else device-wide use (total - free) after the runs.

    The second is an upper bound on this process's peak (it includes the CUDA context and any other
    process): the engine allocates weights, KV pages and workspaces at load and nothing per token.
    """
    for key in ("peak_gpu_bytes", "peak_memory_bytes", "gpu_peak_bytes"):
        if isinstance(info.get(key), int):
            return info[key]
    try:
        import cupy

        free, total = cupy.cuda.runtime.memGetInfo()
        return int(total - free)
    except Exception:
        return None


def _gpu_pool_bytes() -> int | None:
    """Bytes CuPy's default memory pool holds (the engine's device buffers come from it)."""
    try:
        import cupy

        return int(cupy.get_default_memory_pool().total_bytes())
    except Exception:
        return None


def _fmt(x, spec: str, unit: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{unit}"


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def _table(r: dict) -> str:
    where = r["device"] + (f" ({r['gpu_name']})" if r["gpu_name"] else "")
    gen = [x["generated_tokens"] for x in r["runs"]]
    lines = [
        f"model     {r['model']}  [{r['model_path']}]",
        f"device    {where}, mode {r['mode']}, load {r['load_s']:.2f} s",
        f"protocol  prompt {r['prompt_tokens']} tokens, generate {r['gen_tokens']} greedy, "
        f"median of {len(r['runs'])} runs",
        f"prefill   {_fmt(r['prefill_ms'], '.2f', ' ms')}   {_fmt(r['prefill_tok_s'], ',.0f', ' tok/s')}",
        f"decode    {_fmt(r['decode_ms_per_token'], '.3f', ' ms/token')}   {_fmt(r['decode_tok_s'], ',.1f', ' tok/s')}",
        f"traffic   {r['bytes_per_token'] / 1e9:.3f} GB/token ({r['weight_bytes_per_token'] / 1e9:.3f} GB weights "
        f"+ KV at mean context {r['mean_context']:.0f}) -> {_fmt(r['achieved_gbs'], ',.0f', ' GB/s')} = "
        f"{_fmt(r['pct_of_copy_bw'], '.1f', '%')} of {r['copy_bw_gbs']:,.0f} GB/s copy bandwidth",
        "memory    "
        + (
            f"peak GPU {_gib(r['peak_gpu_mem_bytes'])} (device-wide), CuPy pool {_gib(r['gpu_pool_bytes'])}, "
            if r["device"] == "cuda"
            else ""
        )
        + f"peak host RSS {_gib(r['peak_host_rss_bytes'])}",
    ]
    if min(gen) < r["gen_tokens"]:
        lines.append(f"note      some runs stopped early (generated {min(gen)} of {r['gen_tokens']} tokens)")
    return "\n".join(lines)
