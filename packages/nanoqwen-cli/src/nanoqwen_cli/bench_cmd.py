"""`nanoqwen-cli bench`: prefill/decode speed with bandwidth napkin math, sweeps and concurrency, in the
manner of llama-bench.

Protocol (single stream): a P-token prompt, G generated tokens, greedy, `--warmup` untimed runs then
`--runs` timed ones; each row reports the median beside mean ± stddev over the timed runs. Defaults
P = 512, G = 128: the decode protocol of docs/PERF.md ("Method"). Decode speed is judged against the bytes a
token must read (bandwidth.py) and, on the GPU, the copy bandwidth measured on the H200 here (4.19 TB/s,
--copy-bw); a CPU run has no such reference and shows none. `--prompt-tokens 128,512,2048` and
`--gen-tokens` sweep; `--concurrency 1,8,32,64` measures N requests at once (bench_concurrency.py).
"""

from __future__ import annotations

import resource
from pathlib import Path

import click

from nanoqwen_cli import bandwidth, bench_report, session
from nanoqwen_cli.errors import CliError
from nanoqwen_cli.options import (
    count_option,
    decode_activations_option,
    lm_head_dtype_option,
    model_options,
    prefill_weights_option,
)

MEASURED_COPY_BW_GBS = 4190.0  # device-to-device copy on the H200 here, read + write (docs/PERF.md)

# Words that the Qwen2 tokenizer keeps as one token each after a space, so that N of them is N tokens
# whatever their order; the bench checks the count with the model's own tokenizer anyway.
_FILLER = (" the", " of", " and", " to", " in", " is", " that", " for", " it", " with", " as", " on")


class IntList(click.ParamType):
    """`128,512,2048`: one or more integers, each at least `min`, in the order given, without repeats."""

    name = "N[,N...]"

    def __init__(self, min: int):
        self.min = min

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        try:
            values = [int(v) for v in str(value).split(",") if v.strip()]
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of integers", param, ctx)
        if not values or min(values) < self.min:
            self.fail(f"{value!r}: each value must be an integer >= {self.min}", param, ctx)
        return list(dict.fromkeys(values))


@click.command(short_help="Prefill/decode speed, GB/s, memory; sweeps and concurrency levels.")
@model_options
@click.option(
    "--synthetic",
    type=click.Choice(["7b", "tiny"]),
    default=None,
    help="Bench a random model of this shape, written once into $NANOQWEN_CACHE (no download).",
)
@click.option(
    "--prompt-tokens",
    type=IntList(min=1),
    default="512",
    show_default=True,
    help="Prompt length(s): 128,512,2048.",
)
@click.option(
    "--gen-tokens", type=IntList(min=2), default="128", show_default=True, help="Generated tokens: 64,128."
)
@click.option(
    "--concurrency",
    type=IntList(min=1),
    default=None,
    help="Submit N requests at once through the engine's batched API (levels: 1,8,32,64): aggregate "
    "tok/s (prefills included), decode tok/s (once every request has its first token), time to first "
    "token and inter-token latency p50/p99 per level.",
)
@count_option("--runs", default=5, help="Timed runs per test (or level).")
@count_option("--warmup", default=1, lo=0, help="Untimed runs first.")
@click.option(
    "--eager", is_flag=True, help="Decode with eager kernel launches instead of the CUDA graph (cuda only)."
)
@click.option(
    "--copy-bw",
    type=click.FloatRange(min=0.0, min_open=True),
    default=None,
    help=f"Copy bandwidth in GB/s to compare the achieved GB/s with. Default on cuda: {MEASURED_COPY_BW_GBS:.0f} "
    "(measured on the H200); on the CPU: no comparison.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(list(bench_report.FORMATS)),
    default="md",
    show_default=True,
    help="md: a markdown table; csv: one row per test (or level); json: one record (a list for a sweep).",
)
@click.option(
    "--prefill-chunk-idle",
    type=click.IntRange(min=1),
    default=None,
    help="Prompt tokens prefilled per step while no request decodes (default: the engine's, 8192 on the "
    "GPU); 512 times a prompt in the steps a busy server gives it.",
)
@prefill_weights_option
@decode_activations_option
@lm_head_dtype_option
@click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
@click.pass_context
def bench(ctx, model, device, max_context, synthetic, prompt_tokens, gen_tokens, concurrency, runs,
          warmup, eager, copy_bw, prefill_chunk_idle, prefill_weights, decode_activations, lm_head_dtype, fmt, as_json):  # fmt: skip
    """Measure prefill and decode speed, achieved GB/s and peak memory; or, with --concurrency, the
    throughput and latencies of many requests at once.

    Decode GB/s counts the bytes each token reads (INT4 projections + scales + lm_head from the file's
    tensor table, the lm_head as --lm-head-dtype stores it, + K/V at the mean context) over the median
    ms/token.

    \b
    Examples:
        nanoqwen-cli bench --synthetic 7b                          # 7B-shaped random weights, no download
        nanoqwen-cli bench --synthetic 7b --prompt-tokens 128,512,2048 --format csv
        nanoqwen-cli bench --synthetic 7b --concurrency 1,8,32,64 --prompt-tokens 128 --gen-tokens 256
        nanoqwen-cli bench --device cpu --synthetic tiny --prompt-tokens 32 --gen-tokens 8 --runs 2
    """
    from nanoqwen_engine.kv_pages import pages_for

    fmt = "json" if as_json else fmt
    quiet = fmt != "md"
    if eager and device != "cuda":
        raise click.UsageError(
            "--eager selects the GPU's no-graph decode; the CPU reference has no CUDA graphs"
        )
    if device == "cuda":
        session.require_gpu()  # before writing a 5 GB synthetic model that could not be benched
        copy_bw = MEASURED_COPY_BW_GBS if copy_bw is None else copy_bw
    if synthetic is not None:
        if ctx.get_parameter_source("model") not in (click.core.ParameterSource.DEFAULT, None):
            raise click.UsageError("give either --model or --synthetic, not both")
        model = str(synthetic_model(synthetic, quiet=quiet))
    context_needed = max(prompt_tokens) + max(gen_tokens)
    if max_context is None:
        max_context = context_needed
    elif max_context < context_needed:
        raise click.BadParameter(
            f"{max_context} is below the longest prompt + generated = {context_needed} tokens",
            param_hint="'--max-context'",
        )
    engine_kwargs = {"decode_mode": "eager"} if eager else {}
    if prefill_chunk_idle is not None:
        engine_kwargs["prefill_chunk_idle"] = prefill_chunk_idle
    if prefill_weights is not None:
        engine_kwargs["prefill_weights"] = prefill_weights
    if decode_activations is not None:
        engine_kwargs["decode_activations"] = decode_activations
    if lm_head_dtype is not None:
        engine_kwargs["lm_head_dtype"] = lm_head_dtype
    if concurrency:
        # Room for every request of the highest level at once, so that a level measures batching, not
        # queueing or preemption.
        engine_kwargs.update(
            max_batch=max(concurrency), kv_pages=max(concurrency) * pages_for(max_context) + 1
        )

    loaded = session.load(model, device, max_context, progress=not quiet, **engine_kwargs)
    if synthetic is not None:
        loaded.model = f"synthetic {synthetic} (random weights, seed 0)"
    engine = loaded.engine
    records = []
    for p in prompt_tokens:
        prompt = bench_prompt(engine, p)
        for g in gen_tokens:
            # ignore_eos: the protocol times exactly g tokens, whatever the (random) model says.
            params = session.make_params({"temperature": 0.0, "max_tokens": g, "ignore_eos": True})
            if concurrency:
                from nanoqwen_cli.bench_concurrency import measure_level

                ids = engine.encode_prompt(prompt)
                levels = [measure_level(engine, ids, params, n, runs, warmup) for n in concurrency]
                records.append({**_common(loaded, p, g, runs, warmup, eager), "levels": levels})
                continue
            for _ in range(warmup):
                session.complete(engine, prompt, params)
            runs_done = [_run_record(session.complete(engine, prompt, params)[1]) for _ in range(runs)]
            records.append(_summary(loaded, runs_done, p, g, copy_bw, eager, warmup))
    click.echo(bench_report.FORMATS[fmt](records))


def synthetic_model(name: str, quiet: bool) -> Path:
    """The cached random model of shape `name`; written once and reused by later benches (the writer
    writes a temporary file and renames it, so an interrupted write leaves nothing that looks done)."""
    from nanoqwen_format.synthetic import qwen7b_config, tiny_config, write_synthetic

    path = session.cache_dir() / f"synthetic-{name}-seed0.nanoqwen"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not quiet:
            click.echo(f"writing a synthetic {name} model to {path} (once)", err=True)
        write_synthetic(path, qwen7b_config() if name == "7b" else tiny_config(), seed=0)
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
        "prefill_tok_s": stats.prompt_tokens / stats.prefill_s if stats.prefill_s > 0 else None,
        "decode_ms_per_token": stats.decode_s * 1e3 / decode_steps if decode_steps else None,
        "decode_tok_s": decode_steps / stats.decode_s if decode_steps and stats.decode_s > 0 else None,
        "finish_reason": stats.finish_reason,
    }


def _common(loaded, prompt_tokens, gen_tokens, runs, warmup, eager) -> dict:
    """The fields every record has: what ran where, and what it cost in memory."""
    info = dict(loaded.engine.info or {})
    cuda = loaded.device == "cuda"
    return {
        "model": loaded.model,
        "model_path": str(loaded.path),
        "device": loaded.device,
        "gpu_name": _gpu_name(info) if cuda else None,
        "mode": info.get("decode_mode", "eager" if eager else "graph") if cuda else "reference",
        "prompt_tokens": prompt_tokens,
        "gen_tokens": gen_tokens,
        "n_runs": runs,
        "warmup": warmup,
        "load_s": loaded.load_s,
        "peak_gpu_mem_bytes": _peak_gpu_bytes(info) if cuda else None,
        "gpu_pool_bytes": _gpu_pool_bytes() if cuda else None,
        "peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "engine_info": {k: v for k, v in info.items() if isinstance(v, (int, float, str, bool, type(None)))},
    }


def _summary(loaded, records, prompt_tokens, gen_tokens, copy_bw, eager, warmup) -> dict:
    from nanoqwen_format import open_model

    prefill = bench_report.spread(r["prefill_ms"] for r in records)
    prefill_rate = bench_report.spread(r["prefill_tok_s"] for r in records)
    per_token = bench_report.spread(r["decode_ms_per_token"] for r in records)
    decode_rate = bench_report.spread(r["decode_tok_s"] for r in records)
    decode_ms = per_token["median"]
    with _opened(open_model(loaded.path)) as nq:
        counts = bandwidth.decode_bytes(nq, loaded.engine.info["lm_head_dtype"])
    mean_context = prompt_tokens + gen_tokens / 2
    bytes_per_token = counts.at_context(mean_context)
    gbs = bytes_per_token / (decode_ms * 1e-3) / 1e9 if decode_ms else None
    return {
        **_common(loaded, prompt_tokens, gen_tokens, len(records), warmup, eager),
        "prefill_ms": prefill["median"],
        "prefill_tok_s": prompt_tokens / (prefill["median"] * 1e-3) if prefill["median"] else None,
        "prefill_tok_s_spread": prefill_rate,
        "decode_ms_per_token": decode_ms,
        "decode_tok_s": 1e3 / decode_ms if decode_ms else None,
        "decode_tok_s_spread": decode_rate,
        "bytes_per_token": bytes_per_token,
        "weight_bytes_per_token": counts.projections + counts.scales + counts.lm_head,
        "kv_bytes_per_context_token": counts.kv_per_token,
        "mean_context": mean_context,
        "achieved_gbs": gbs,
        "copy_bw_gbs": copy_bw,
        "pct_of_copy_bw": 100.0 * gbs / copy_bw if gbs and copy_bw else None,
        "min_generated": min(r["generated_tokens"] for r in records),
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
