"""How the CLI prints measured rates: the digits that matter, never a bare 0 for a rate that was measured."""

from __future__ import annotations

import math


def rate(x: float | None) -> str:
    """A rate with the digits that matter: 27,025 / 464.0 / 3.71 / 0.0412, never a bare 0 for a rate
    that was measured (a 1.5B model decodes well under 1 tok/s on a small CPU)."""
    if x is None or not math.isfinite(x):
        return "n/a"
    if x >= 1000:
        return f"{x:,.0f}"
    if x >= 100:
        return f"{x:.1f}"
    return f"{x:.3g}"
