"""Click options shared by several commands: which model, which device, how to sample."""

from __future__ import annotations

import functools

import click

DEFAULT_MODEL = "Qwen/Qwen2.5-Coder-7B-Instruct"

# SamplingParams field -> CLI value; None means "not given: the model's generation_config decides".
SAMPLING_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "seed",
    "max_tokens",
    "stop",
)


def model_options(func):
    """--model, --device, --max-context."""

    @click.option(
        "--model",
        "-m",
        default=DEFAULT_MODEL,
        show_default=True,
        envvar="NANOQWEN_MODEL",
        help="A .nanoqwen file, a local Hugging Face folder, or a hub id (downloaded and converted once "
        "into $NANOQWEN_CACHE). Env: NANOQWEN_MODEL.",
    )
    @click.option(
        "--device",
        type=click.Choice(["cuda", "cpu"]),
        default="cuda",
        show_default=True,
        help="cuda: the Hopper GPU engine. cpu: the numpy reference backend (small models, no GPU).",
    )
    @click.option(
        "--max-context",
        type=click.IntRange(min=1),
        default=None,
        help="Tokens of context (prompt + answer) to reserve KV pages for. Default: the engine's choice "
        "(free memory / the model's limit).",
    )
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        return func(*args, **kwargs)

    return wrapper


def sampling_options(func):
    """The SamplingParams flags; unset ones fall back to the model's generation_config."""

    @click.option(
        "--temperature",
        "-t",
        type=click.FloatRange(min=0.0),
        default=None,
        help="Softmax temperature; 0 = greedy. Default: the model's generation_config.",
    )
    @click.option(
        "--top-k", type=click.IntRange(min=0), default=None, help="Keep the k most likely tokens (0 = off)."
    )
    @click.option(
        "--top-p",
        type=click.FloatRange(0.0, 1.0, min_open=True),
        default=None,
        help="Nucleus sampling: keep the smallest set of tokens with this much probability.",
    )
    @click.option(
        "--min-p",
        type=click.FloatRange(0.0, 1.0),
        default=None,
        help="Drop tokens below min_p x the top probability.",
    )
    @click.option(
        "--repetition-penalty",
        type=click.FloatRange(min=0.0, min_open=True),
        default=None,
        help="Penalty for tokens already seen (1.0 = off), as transformers defines it.",
    )
    @click.option("--seed", type=int, default=None, help="Seed for reproducible sampling.")
    @click.option(
        "--max-tokens", "-n", type=click.IntRange(min=1), default=None, help="Most tokens to generate."
    )
    @click.option(
        "--stop", multiple=True, help="Stop when this text appears (repeatable); it is not printed."
    )
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        return func(*args, **kwargs)

    return wrapper


def sampling_overrides(kwargs: dict) -> dict:
    """Pop the sampling flags out of a command's kwargs, keeping only those the user gave."""
    given = {}
    for name in SAMPLING_FIELDS:
        value = kwargs.pop(name, None)
        if name == "stop":
            value = list(value) if value else None
        if value is not None:
            given[name] = value
    return given
