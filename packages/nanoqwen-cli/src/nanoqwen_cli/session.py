"""The CLI's one door into the engine: resolve and load a model, build SamplingParams, stream a request.

Kept in one file so that the commands stay free of engine details, and so that the one place to adapt
when the engine's API moves is here.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from pathlib import Path

import click

from nanoqwen_cli.errors import CliError


@dataclass
class Loaded:
    engine: object  # nanoqwen_engine.Engine
    path: Path  # the .nanoqwen file actually loaded (after download/convert)
    model: str  # what the user asked for (--model)
    device: str
    load_s: float  # Engine.load only: download/convert time is not load time


def load(
    model: str, device: str, max_context: int | None, *, progress: bool = True, **engine_kwargs
) -> Loaded:
    """Resolve `model` (file, HF folder, hub id) to a cached .nanoqwen file, then load it on `device`."""
    from nanoqwen_engine import Engine
    from nanoqwen_engine.model_source import resolve_model

    check_engine_kwargs(**engine_kwargs)
    if device == "cuda":
        require_gpu()  # before a 15 GB download and conversion that could not be used
    path = Path(resolve_model(model, progress=progress))
    t0 = time.perf_counter()
    engine = Engine.load(path, device=device, max_context=max_context, progress=progress, **engine_kwargs)
    return Loaded(engine, path, model, device, time.perf_counter() - t0)


def check_engine_kwargs(**engine_kwargs) -> None:
    """CliError if Engine.load does not take these keyword arguments (say decode_mode, which is newer)."""
    from nanoqwen_engine import Engine

    accepted = inspect.signature(Engine.load).parameters
    if any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        return
    for name, value in engine_kwargs.items():
        if name not in accepted:
            raise CliError(f"this nanoqwen-engine's Engine.load does not take {name}={value!r} yet")


def make_params(overrides: dict):
    """SamplingParams with the flags the user gave; the engine fills the rest from generation_config."""
    from nanoqwen_engine import SamplingParams

    return SamplingParams(**{k: v for k, v in overrides.items() if v is not None})


def messages_for(prompt: str, system: str | None) -> list[dict]:
    """One user turn, with an optional system turn (the chat template supplies its default otherwise)."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": prompt})
    return messages


def messages_for_history(history: list[dict], system: str | None) -> list[dict]:
    """The whole conversation so far, with an optional system turn first."""
    return ([{"role": "system", "content": system}] if system is not None else []) + list(history)


@dataclass
class Stats:
    """What a request cost, as the engine reports it on its last event (Completion.stats)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tok_s(self) -> float:
        # The first generated token comes out of the prefill; decode steps produce the rest.
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 and steps else float("nan")


def stream(engine, request, params, stats: Stats):
    """Yield text deltas of `request` (str: raw completion; list of messages: chat), filling `stats`.

    The engine's last event carries the request's own timings; closing this generator (Ctrl-C in chat)
    closes the engine's, which frees the sequence's KV pages.
    """
    events = engine.generate(request, params)
    try:
        for event in events:
            stats.token_ids.append(int(event.token_id))
            if event.finish_reason is not None:
                stats.finish_reason = event.finish_reason
            if event.stats is not None:
                _copy_stats(event.stats, stats)
            if event.text:
                yield event.text
    finally:
        events.close()
    stats.generated_tokens = len(stats.token_ids)


def _copy_stats(src: dict, dst: Stats) -> None:
    """The engine's stats dict (last GenerationEvent, Completion.stats) into a Stats."""
    for name in ("prompt_tokens", "generated_tokens", "prefill_s", "decode_s"):
        if src.get(name) is not None:
            setattr(dst, name, src[name])


def format_stats(loaded: Loaded, stats: Stats) -> str:
    return (
        f"load {loaded.load_s:.2f} s | prompt {stats.prompt_tokens} tokens, "
        f"{stats.prefill_tok_s:.1f} tok/s prefill | generated {stats.generated_tokens} tokens, "
        f"{stats.decode_tok_s:.1f} tok/s decode | finish: {stats.finish_reason}"
    )


def echo_stats(loaded: Loaded, stats: Stats) -> None:
    click.echo(format_stats(loaded, stats), err=True)


def complete(engine, request, params) -> tuple[str, Stats]:
    """One whole request through `engine.complete`; the text and its Stats."""
    completion = engine.complete(request, params)
    stats = Stats(finish_reason=completion.finish_reason, token_ids=[int(t) for t in completion.token_ids])
    _copy_stats(completion.stats, stats)
    return completion.text, stats


def cache_dir() -> Path:
    """$NANOQWEN_CACHE, else ~/.cache/nanoqwen: where converted and synthetic models live (the engine's)."""
    from nanoqwen_engine.model_source import cache_dir as engine_cache_dir

    return Path(engine_cache_dir())


def require_gpu() -> None:
    """NoGPUError now, for commands that would otherwise spend minutes before the engine finds out."""
    from nanoqwen_engine import NoGPUError
    from nanoqwen_kernels import gpu_status

    ok, reason = gpu_status()
    if not ok:
        raise NoGPUError(f"no usable GPU: {reason}")
