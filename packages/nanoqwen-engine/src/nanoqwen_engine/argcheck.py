"""Strict checks of caller- and file-supplied numbers, shared by SamplingParams, ModelConfig and Engine.load.

Each check takes the exception class to raise, so a bad request argument is an InvalidRequestError and
a bad value inside a model file a ConfigError, both with a one-line message naming the field. Python's
own conversions are deliberately not used: `int("3")`, `int(2.7)`, `int(True)` and `float("nan")` all
succeed, and each hides a caller's mistake.
"""

from __future__ import annotations

import math
from typing import Any

from .errors import NanoqwenError


def _typename(v: Any) -> str:
    return type(v).__name__


def is_int(v: Any) -> bool:
    """A real integer (Python int or numpy integer), never a bool."""
    import numpy as np

    return isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_)


def check_int(name: str, v: Any, err: type[NanoqwenError], lo: int | None = None, hi: int | None = None) -> int:
    """v as an int in [lo, hi] (either bound optional), or err naming `name`."""
    if not is_int(v):
        raise err(f"{name} must be an integer, got {v!r} ({_typename(v)})")
    v = int(v)
    if lo is not None and v < lo:
        raise err(f"{name} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise err(f"{name} must be <= {hi}, got {v}")
    return v


def check_float(name: str, v: Any, err: type[NanoqwenError]) -> float:
    """v as a finite float (ints accepted), or err naming `name`."""
    import numpy as np

    if isinstance(v, bool | np.bool_) or not isinstance(v, int | float | np.integer | np.floating):
        raise err(f"{name} must be a number, got {v!r} ({_typename(v)})")
    try:
        f = float(v)
    except OverflowError:  # an int too large for a float
        raise err(f"{name} must be a finite number, got {v!r}") from None
    if not math.isfinite(f):
        raise err(f"{name} must be a finite number, got {v!r}")
    return f


def check_bool(name: str, v: Any, err: type[NanoqwenError]) -> bool:
    if not isinstance(v, bool):
        raise err(f"{name} must be True or False, got {v!r} ({_typename(v)})")
    return v
