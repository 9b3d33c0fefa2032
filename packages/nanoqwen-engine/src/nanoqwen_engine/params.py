"""SamplingParams: what a request asks of the sampler and the stop logic.

A field left at None takes the model's default from its embedded generation_config (`resolve`), so
`SamplingParams()` samples the way the model's authors published. `temperature=0` is greedy decoding: the
knobs the caller did not set then resolve to neutral values (no top-k/top-p/min-p, repetition penalty 1),
so greedy means the argmax of the model's own logits, the quantity the validation ladder compares across
backends. A repetition penalty set explicitly still applies under greedy, as in transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from .errors import InvalidRequestError

DEFAULT_MAX_TOKENS = 512


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None  # new tokens at most; default DEFAULT_MAX_TOKENS
    temperature: float | None = None  # 0 = greedy
    top_k: int | None = None  # 0 = off
    top_p: float | None = None  # 1.0 = off
    min_p: float | None = None  # 0.0 = off
    repetition_penalty: float | None = None  # 1.0 = off
    seed: int | None = None  # None: a fresh random seed per request
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings; the text ends before the match
    ignore_eos: bool = False  # keep going past eos ids (benchmarks that must produce max_tokens tokens)

    def __post_init__(self):
        if self.stop is None:
            object.__setattr__(self, "stop", ())
        elif isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str):
            raise InvalidRequestError(f"SamplingParams: {msg}")

        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature is not None and self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            bad(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad(f"stop must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def resolve(self, generation_config: dict | None) -> SamplingParams:
        """Every None filled: from generation_config, or neutral under greedy (see the module doc)."""
        gc = generation_config or {}
        temperature = self.temperature
        if temperature is None:
            temperature = float(gc.get("temperature", 1.0)) if gc.get("do_sample", True) else 0.0
        greedy = temperature == 0
        neutral = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
        vals = {}
        for name, off in neutral.items():
            v = getattr(self, name)
            if v is None:
                v = off if greedy or gc.get(name) is None else gc[name]
            vals[name] = v
        return replace(
            self,
            max_tokens=self.max_tokens or int(gc.get("max_new_tokens") or DEFAULT_MAX_TOKENS),
            temperature=float(temperature),
            top_k=int(vals["top_k"]),
            top_p=float(vals["top_p"]),
            min_p=float(vals["min_p"]),
            repetition_penalty=float(vals["repetition_penalty"]),
        )

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
