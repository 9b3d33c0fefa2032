"""SamplingParams: what a request asks of the sampler and the stop logic.

A field left at None takes the model's default from its embedded generation_config (`resolve`), so
`SamplingParams()` samples the way the model's authors published. `temperature=0` is greedy decoding: the
knobs the caller did not set then resolve to neutral values (no top-k/top-p/min-p, repetition penalty 1),
so greedy means the argmax of the model's own logits, the quantity the validation ladder compares across
backends. A repetition penalty set explicitly still applies under greedy, as in transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from .argcheck import check_bool, check_float, check_int
from .errors import ConfigError, InvalidRequestError

DEFAULT_MAX_TOKENS = 512
RANDOM_SEED = -1  # seed=-1 asks for a fresh random seed, as llama.cpp's --seed -1 does (same as None)
MAX_SEED = 2**64 - 1  # numpy's SeedSequence takes any non-negative int; 64 bits is what a GPU RNG keeps


def _in_range(name: str, v: float, ok: bool, want: str, err: type) -> float:
    if not ok:
        raise err(f"{name} must be in {want}, got {v}")
    return v


def _check_field(name: str, v: Any, err: type, prefix: str = "SamplingParams.") -> Any:
    """One knob's value, type- and range-checked; `err` names prefix + name."""
    label = prefix + name
    if name in ("max_tokens", "max_new_tokens"):
        return check_int(label, v, err, lo=1)
    if name == "top_k":
        return check_int(label, v, err, lo=0)
    f = check_float(label, v, err)
    if name == "temperature":
        return _in_range(label, f, f >= 0, "[0, inf)", err)
    if name == "top_p":
        return _in_range(label, f, 0 < f <= 1, "(0, 1]", err)
    if name == "min_p":
        return _in_range(label, f, 0 <= f <= 1, "[0, 1]", err)
    if name == "repetition_penalty":
        return _in_range(label, f, f > 0, "(0, inf)", err)
    raise AssertionError(name)


GENERATION_CONFIG_KNOBS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens")


def check_generation_config(gc) -> None:
    """Every sampling default a model file's generation_config carries, checked once (at load): a
    value of the wrong type or out of range is a ConfigError naming the key, whether or not a request
    would read it."""
    if gc is None:
        return
    if not isinstance(gc, dict):
        raise ConfigError(f"generation_config must be a JSON object, got {type(gc).__name__}")
    if "do_sample" in gc:
        check_bool("generation_config.do_sample", gc["do_sample"], ConfigError)
    for name in GENERATION_CONFIG_KNOBS:
        if gc.get(name) is not None:
            _check_field(name, gc[name], ConfigError, prefix="generation_config.")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None  # new tokens at most; default DEFAULT_MAX_TOKENS
    temperature: float | None = None  # 0 = greedy
    top_k: int | None = None  # 0 = off
    top_p: float | None = None  # 1.0 = off
    min_p: float | None = None  # 0.0 = off
    repetition_penalty: float | None = None  # 1.0 = off
    seed: int | None = None  # None or -1: a fresh random seed per request (reported in the stats)
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings; the text ends before the match
    ignore_eos: bool = False  # keep going past eos ids (benchmarks that must produce max_tokens tokens)

    def __post_init__(self):
        """Every field is checked here, when the params are built: a bad value raises InvalidRequestError
        naming the field, never an error later inside the sampler."""
        for name in ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, _check_field(name, v, InvalidRequestError))
        if self.seed is not None:
            seed = check_int("SamplingParams.seed", self.seed, InvalidRequestError, lo=RANDOM_SEED, hi=MAX_SEED)
            object.__setattr__(self, "seed", None if seed == RANDOM_SEED else seed)
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, list | tuple):
            stop = tuple(stop)
        else:
            raise InvalidRequestError(f"SamplingParams.stop must be a string or a list of strings, got "
                                      f"{type(stop).__name__}")
        if any(not isinstance(s, str) or not s for s in stop):
            raise InvalidRequestError(f"SamplingParams.stop must be non-empty strings, got {stop!r}")
        object.__setattr__(self, "stop", stop)
        check_bool("SamplingParams.ignore_eos", self.ignore_eos, InvalidRequestError)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def resolve(self, generation_config: dict | None) -> SamplingParams:
        """Every None filled: from generation_config, or neutral under greedy (see the module doc).

        A generation_config value of the wrong type or out of range raises ConfigError (the file is
        wrong, not the request); Engine.load resolves once with every knob read, so a bad file is
        refused at load.
        """
        gc = generation_config or {}

        def from_file(name: str):
            return _check_field(name, gc[name], ConfigError, prefix="generation_config.")

        temperature = self.temperature
        if temperature is None:
            do_sample = check_bool("generation_config.do_sample", gc.get("do_sample", True), ConfigError)
            temperature = (from_file("temperature") if "temperature" in gc else 1.0) if do_sample else 0.0
        greedy = temperature == 0
        neutral = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
        vals = {}
        for name, off in neutral.items():
            v = getattr(self, name)
            if v is None:
                v = off if greedy or gc.get(name) is None else from_file(name)
            vals[name] = v
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = from_file("max_new_tokens") if gc.get("max_new_tokens") is not None else DEFAULT_MAX_TOKENS
        return replace(
            self,
            max_tokens=max_tokens,
            temperature=float(temperature),
            top_k=int(vals["top_k"]),
            top_p=float(vals["top_p"]),
            min_p=float(vals["min_p"]),
            repetition_penalty=float(vals["repetition_penalty"]),
        )

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
