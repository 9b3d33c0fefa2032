"""The CLI's one door into the engine: resolve, check and load a model, build SamplingParams, stream a
request.

Kept in one file so that the commands stay free of engine details, and so that the one place to adapt
when the engine's API moves is here. Loading goes: the GPU is there (before a download it could not
use) -> the model is resolved (downloaded and converted once) -> its header's limits are checked against
the flags (usage errors, before any weight is read) -> the engine loads while the file's CRCs are
checked on a second thread (first load of a file only) -> a damaged file fails with one line.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import click

from nanoqwen_cli.display import rate
from nanoqwen_cli.errors import CliError
from nanoqwen_cli.progress import PromptProgress


@dataclass
class Loaded:
    engine: object  # nanoqwen_engine.Engine
    path: Path  # the .nanoqwen file actually loaded (after download/convert)
    model: str  # what the user asked for (--model)
    device: str
    load_s: float  # Engine.load only: download/convert time is not load time


def load(
    model: str,
    device: str,
    max_context: int | None,
    *,
    progress: bool = True,
    verify: bool | None = None,
    **engine_kwargs,
) -> Loaded:
    """Resolve `model` (file, cache name, HF folder, hub id) to a .nanoqwen file, then load it on `device`.

    verify: check the file's CRCs unless a record says they passed before; None: unless --no-verify."""
    from nanoqwen_engine import Engine, model_source

    if device == "cuda":
        require_gpu()  # before a 15 GB download and conversion that could not be used
    resolved = model_source.resolve(model, progress=progress)
    path = resolved.path
    if resolved.converted and progress:
        note_download(resolved.meta)
    config, file_bytes = read_header(path)
    check_max_context(max_context, config, device, file_bytes)
    if verify is None:
        from nanoqwen_cli.options import no_verify_given

        verify = not no_verify_given()
    check = _Verification(path) if verify else None
    t0 = time.perf_counter()
    engine = Engine.load(path, device=device, max_context=max_context, progress=progress, **engine_kwargs)
    load_s = time.perf_counter() - t0
    if check is not None:
        check.result()
    return Loaded(engine, path, model, device, load_s)


def read_header(path: Path) -> tuple[dict, int]:
    """The model's config and the file's size, from the header alone (no tensor is read)."""
    from nanoqwen_format import NanoqwenFormatError, open_model

    try:
        with open_model(path) as nq:
            return dict(nq.config), path.stat().st_size
    except NanoqwenFormatError as e:
        text = str(e)
        raise CliError(text if str(path) in text else f"{path}: {text}") from None


def model_limit(config: dict) -> int:
    """The longest context the model was trained for (what the engine caps a sequence at)."""
    return int(config.get("max_position_embeddings") or 32768)


def check_max_context(max_context: int | None, config: dict, device: str, file_bytes: int) -> None:
    """A usage error when --max-context exceeds the model's limit or, on the GPU, its free memory."""
    if max_context is None:
        return
    limit = model_limit(config)
    if max_context > limit:
        raise click.BadParameter(
            f"{max_context} is beyond this model's limit; the accepted range is 1..{limit} tokens "
            "(its max_position_embeddings)",
            param_hint="'--max-context'",
        )
    if device != "cuda":
        return  # the CPU reference maps its KV cache lazily: memory is taken as tokens arrive
    from nanoqwen_cli.bandwidth import kv_bytes_per_token

    free = gpu_free_bytes()
    per_token = kv_bytes_per_token(config)
    if free is not None and file_bytes + per_token * max_context > free:
        fits = max((free - file_bytes) // per_token, 0)
        raise click.BadParameter(
            f"{max_context} tokens of KV cache ({per_token * max_context / 2**30:.1f} GiB) and the weights "
            f"({file_bytes / 2**30:.1f} GiB) do not fit the GPU's {free / 2**30:.1f} GiB free; the accepted "
            f"range here is 1..{min(fits, limit)}",
            param_hint="'--max-context'",
        )


def gpu_free_bytes() -> int | None:
    """Free memory on the current GPU, or None when it cannot be asked (no CuPy)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.memGetInfo()[0])
    except Exception:
        return None


class _Verification:
    """The file's CRC check, run beside Engine.load (zlib releases the GIL), skipped when a record says
    the file passed before (nanoqwen_format.integrity)."""

    def __init__(self, path: Path):
        from nanoqwen_engine.model_source import verified_dir
        from nanoqwen_format.integrity import is_verified

        self.path, self.records, self.error = path, verified_dir(), None
        self.thread = None
        if not is_verified(path, self.records):
            # A daemon: if the load fails first, its error is reported without waiting for the check.
            self.thread = threading.Thread(target=self._run, name="nanoqwen-verify", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        from nanoqwen_format.integrity import verify_once

        try:
            verify_once(self.path, self.records)
        except Exception as e:
            self.error = e

    def result(self) -> None:
        if self.thread is None:
            return
        self.thread.join()
        if self.error is not None:
            raise CliError(
                f"{self.error} (the file is damaged: convert or download it again; --no-verify loads it anyway)"
            )


def download_note(meta: dict, how: str) -> str | None:
    """For a hub model: where its download stays in the Hugging Face cache and its size, then `how` to
    drop it; None when there is no download (a folder, or already dropped)."""
    from nanoqwen_engine.model_source import download_size

    where = meta.get("download_dir")
    if meta.get("kind") != "hub" or not where or not Path(where).exists():
        return None
    return (
        f"the download stays in the Hugging Face cache: {where} ({download_size(where) / 1e9:.2f} GB); {how}"
    )


def note_download(meta: dict) -> None:
    """After a hub model's first conversion, say where the download stays and how to drop it."""
    note = download_note(
        meta,
        f"`nanoqwen-cli pull --drop-download {meta.get('source')}` removes it (the converted model does not "
        "need it)",
    )
    if note:
        click.echo(note, err=True)


def make_params(overrides: dict):
    """SamplingParams with the flags the user gave; the engine fills the rest from generation_config."""
    from nanoqwen_engine import SamplingParams

    return SamplingParams(**{k: v for k, v in overrides.items() if v is not None})


def fit_max_tokens(engine, prompt_tokens: int, params):
    """(params, note): --max-tokens capped at what the context leaves after the prompt, with a note
    saying so; the params unchanged (note None) when they fit or were not given."""
    room = engine.max_context - prompt_tokens
    if params.max_tokens is None or params.max_tokens <= room or room < 1:
        return params, None
    note = (
        f"note: --max-tokens {params.max_tokens} capped at {room}: the context holds {engine.max_context} "
        f"tokens and the prompt takes {prompt_tokens}"
    )
    return dataclasses.replace(params, max_tokens=room), note


def sampled(engine, params) -> bool:
    """True when `params` sample (not greedy) once the model's generation_config fills the gaps."""
    return not params.resolve(engine.generation_config).greedy


def messages_for(prompt: str, system: str | None) -> list[dict]:
    """One user turn, with an optional system turn (the chat template supplies its default otherwise)."""
    return messages_for_history([{"role": "user", "content": prompt}], system)


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
    seed: int | None = None
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


def stream(engine, request, params, stats: Stats, *, prompt_tokens: int | None = None, show_progress=False):
    """Yield text deltas of `request` (str: raw completion; list of messages: chat), filling `stats`.

    With `show_progress`, a "processing prompt" line on a terminal's stderr covers the wait for the
    first token (progress.py). The engine's last event carries the request's own timings; closing this
    generator (Ctrl-C in chat) closes the engine's, which cancels the request and frees its KV pages.
    """
    from nanoqwen_engine.request import NO_TOKEN

    events = engine.generate(request, params)
    try:
        with PromptProgress(prompt_tokens, enabled=show_progress):
            first = next(events, None)
        for event in events if first is None else _chain(first, events):
            if event.token_id != NO_TOKEN:
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


def _chain(first, rest):
    yield first
    yield from rest


def _copy_stats(src: dict, dst: Stats) -> None:
    """The engine's stats dict (last GenerationEvent, Completion.stats) into a Stats."""
    for name in ("prompt_tokens", "generated_tokens", "prefill_s", "decode_s", "seed"):
        if src.get(name) is not None:
            setattr(dst, name, src[name])


def format_stats(stats: Stats, *, load_s: float | None = None, show_seed: bool = False) -> str:
    """One line of what a request cost: load time (run only: chat loads once), prefill, decode, seed."""
    parts = [f"load {load_s:.2f} s"] if load_s is not None else []
    parts += [
        f"prompt {stats.prompt_tokens} tokens, {rate(stats.prefill_tok_s)} tok/s prefill",
        f"generated {stats.generated_tokens} tokens, {rate(stats.decode_tok_s)} tok/s decode",
        f"finish: {stats.finish_reason}",
    ]
    if show_seed and stats.seed is not None:
        parts.append(f"seed {stats.seed}")
    return " | ".join(parts)


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
