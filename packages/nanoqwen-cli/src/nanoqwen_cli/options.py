"""Click options shared by several commands: which model, which device, how to sample.

The sampling settings are one table (SAMPLING): it builds the command-line flags and parses chat's
`/set NAME VALUE`, so a value has the same accepted range, and the same message when it is outside it,
wherever it is typed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import click

DEFAULT_MODEL = "Qwen/Qwen2.5-Coder-7B-Instruct"
RANDOM_SEED = -1  # --seed -1: a fresh random seed (llama.cpp's convention); the seed used is reported
MAX_SEED = 2**64 - 1


class FiniteFloatRange(click.FloatRange):
    """A FloatRange that also refuses nan and inf (nan passes every comparison a range makes)."""

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number in the range {self._describe_range()}.", param, ctx)
        return rv


@dataclass(frozen=True)
class Setting:
    """One SamplingParams field as a flag and as chat's `/set` name."""

    field: str  # the SamplingParams field, also the /set name (top_k; /set top-k works too)
    flags: tuple[str, ...]
    type: click.ParamType
    help: str

    def parse(self, text: str):
        """The value of `text` (None for a random seed); click.BadParameter naming the flag and its range."""
        value = self.type.convert(text, _param(self), None)
        return None if self.field == "seed" and value == RANDOM_SEED else value


SAMPLING = (
    Setting(
        "temperature",
        ("--temperature", "-t"),
        FiniteFloatRange(min=0.0),
        "Softmax temperature; 0 = greedy. Default: the model's generation_config.",
    ),
    Setting("top_k", ("--top-k",), click.IntRange(min=0), "Keep the k most likely tokens (0 = off)."),
    Setting(
        "top_p",
        ("--top-p",),
        FiniteFloatRange(0.0, 1.0, min_open=True),
        "Nucleus sampling: keep the smallest set of tokens with this much probability.",
    ),
    Setting(
        "min_p", ("--min-p",), FiniteFloatRange(0.0, 1.0), "Drop tokens below min_p x the top probability."
    ),
    Setting(
        "repetition_penalty",
        ("--repetition-penalty",),
        FiniteFloatRange(min=0.0, min_open=True),
        "Penalty for tokens already seen (1.0 = off), as transformers defines it.",
    ),
    Setting(
        "seed",
        ("--seed",),
        click.IntRange(RANDOM_SEED, MAX_SEED),
        "Seed for reproducible sampling; -1 (or none) draws a fresh one, reported with the timings.",
    ),
    Setting(
        "max_tokens",
        ("--max-tokens", "-n"),
        click.IntRange(min=1),
        "Most tokens to generate (capped at what the context leaves after the prompt).",
    ),
)
SETTINGS = {s.field: s for s in SAMPLING}


def _param(setting: Setting) -> click.Option:
    """A click Option for `setting`, so that /set's errors name the flag the way the command line does."""
    return click.Option(list(setting.flags), type=setting.type)


def find_setting(name: str) -> Setting | None:
    """The Setting called `name` (temperature, top_k, top-k, --top-k, -t, ...), or None."""
    key = name.lstrip("-").replace("-", "_")
    for s in SAMPLING:
        if key == s.field or name in s.flags:
            return s
    return None


NO_VERIFY = "nanoqwen.no_verify"  # click context meta key: --no-verify, read by session.load


def _remember_no_verify(ctx: click.Context, param, value: bool) -> None:
    # Kept in the context rather than passed to the command: every command that loads a model honours it
    # through session.load, without a parameter of its own to thread through.
    ctx.meta[NO_VERIFY] = value


def no_verify_given() -> bool:
    ctx = click.get_current_context(silent=True)
    return bool(ctx is not None and ctx.meta.get(NO_VERIFY))


def count_option(*decls: str, default: int | None, help: str, lo: int = 1):
    """An integer option of at least `lo` (a count of tokens, prompts, runs...), its default shown."""
    return click.option(*decls, type=click.IntRange(min=lo), default=default, show_default=default is not None,
                        help=help)


def model_options(func):
    """--model, --device, --max-context, --no-verify."""

    @click.option(
        "--model",
        "-m",
        default=DEFAULT_MODEL,
        show_default=True,
        envvar="NANOQWEN_MODEL",
        help="A .nanoqwen file, a name from `nanoqwen-cli models`, a local Hugging Face folder, or a hub id "
        "(downloaded and converted once into $NANOQWEN_CACHE). Env: NANOQWEN_MODEL.",
    )
    @click.option(
        "--device",
        type=click.Choice(["cuda", "cpu"]),
        default="cuda",
        show_default=True,
        help="cuda: the Hopper GPU engine. cpu: the numpy reference backend (small models, no GPU).",
    )
    @count_option(
        "--max-context",
        default=None,
        help="Tokens of context (prompt + answer) to reserve KV pages for, up to the model's limit "
        "(max_position_embeddings). Default: the engine's choice (free memory / the model's limit).",
    )
    @click.option(
        "--no-verify",
        is_flag=True,
        expose_value=False,
        callback=_remember_no_verify,
        help="Skip the CRC check of the model file (done once per file; its result is remembered).",
    )
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        return func(*args, **kwargs)

    return wrapper


def sampling_options(func):
    """The SamplingParams flags (SAMPLING) and --stop; unset ones fall back to the model's generation_config."""
    # Decorators apply bottom-up and click lists the last applied first: --stop goes on first to come last.
    func = click.option(
        "--stop", multiple=True, help="Stop when this text appears (repeatable); it is not printed."
    )(func)
    for s in reversed(SAMPLING):
        func = click.option(*s.flags, s.field, type=s.type, default=None, help=s.help)(func)
    return func


def sampling_overrides(kwargs: dict) -> dict:
    """Pop the sampling flags out of a command's kwargs, keeping only those the user gave."""
    given = {}
    for s in SAMPLING:
        value = kwargs.pop(s.field, None)
        if s.field == "seed" and value == RANDOM_SEED:
            value = None
        if value is not None:
            given[s.field] = value
    stop = kwargs.pop("stop", None)
    if stop:
        given["stop"] = list(stop)
    return given


def prefill_weights_option(func):
    """--prefill-weights: what the GPU's prefill GEMMs multiply (Engine.load's prefill_weights)."""
    return click.option(
        "--prefill-weights",
        type=click.Choice(["auto", "fp16", "int4", "fp8"]),
        default=None,
        help="GPU prefill GEMMs: auto (default: $NANOQWEN_PREFILL_WEIGHTS, else a resident fp16 copy where it "
        "fits, else INT4 as stored), fp16, int4, or fp8 (opt-in: activations rounded to e4m3 on the FP8 "
        "tensor cores; faster prompts, slightly different numbers).",
    )(func)


def decode_activations_option(func):
    """--decode-activations: what a single sequence's decode GEMVs multiply the INT4 weights with
    (Engine.load's decode_activations)."""
    return click.option(
        "--decode-activations",
        type=click.Choice(["fp16", "int8"]),
        default=None,
        help="GPU batch-1 decode GEMVs: int8 (default: $NANOQWEN_DECODE_ACTIVATIONS, else int8: the activation "
        "rounded to int8 with a scale per 16 values and multiplied by dp4a, like llama.cpp's q8_1 GEMVs; the "
        "7B decodes ~15% faster, and on the real 1.5B its greedy tokens agree with transformers fp32 as "
        "fp16's do) or fp16 (the activation as it is: a sequence alone then gets the greedy tokens it gets "
        "in a batch). Batches of 2 or more always multiply fp16.",
    )(func)


def lm_head_dtype_option(func):
    """--lm-head-dtype: how the lm_head is stored and multiplied, on either device (Engine.load's
    lm_head_dtype)."""
    return click.option(
        "--lm-head-dtype",
        type=click.Choice(["int8", "fp16"]),
        default=None,
        help="How the lm_head (the last matrix, hidden state -> one logit per vocabulary token) is stored, on "
        "either device: int8 (default: $NANOQWEN_LM_HEAD_DTYPE, else int8) quantizes it at load with one fp16 "
        "scale per 128 values, finer than the Q6_K of llama.cpp's Q4_K_M files: half the bytes of a batch-1 "
        "decode step's largest read (7B: 1.09 of 4.46 GB), slightly different logits. fp16: the file's "
        "values as they are.",
    )(func)
