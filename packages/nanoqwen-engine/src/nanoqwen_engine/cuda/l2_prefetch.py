"""What decode attention warms in L2 for the kernels after it (batch 1): the L2 prefetch plan.

At batch 1 and a short context, decode attention moves ~1.3 MB (7B, context 640) in ~7 us and most of its
grid has no pages: HBM idles while the next kernels (o_proj, then gate/up, then down) wait their turn. Its
idle blocks can issue `cp.async.bulk.prefetch.L2` for weights those kernels will read
(nanoqwen_kernels.attention.l2_prefetch, attention_decode.cu "L2 prefetch"), so part of their bytes come
from L2. This file chooses the ranges per layer from a spec:

    "o"        o_proj's weights and scales (6.6 MB on the 7B, 1.2 MB on the 1.5B)
    "gu:MB"    the first rows of gate and of up (weights and scales), MB megabytes in all; gate/up's
               blocks take their first group of 32 rows from the front (gemv_int4.cu gate_up_a8_image)
    "down:MB"  down_proj's first rows, MB megabytes (units are dealt round-robin over the blocks)

e.g. "o,gu:16". The spec comes from $NANOQWEN_DECODE_PREFETCH (default DEFAULT_SPEC; "" or "none": off).
"""

from __future__ import annotations

import os
from typing import Any

from .weights import GpuLayer, Int4Weight

DEFAULT_SPEC = "none"
_MB = 1 << 20


def parse_spec(spec: str) -> list[tuple[str, float]]:
    """[(item, megabytes)] of a spec ("o,gu:16"); "o" has no size (all of it). ValueError on a bad one."""
    out: list[tuple[str, float]] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if item == "none":
            continue
        name, _, mb = item.partition(":")
        if name == "o" and not mb:
            out.append(("o", 0.0))
        elif name in ("gu", "down") and mb:
            try:
                size = float(mb)
            except ValueError:
                raise ValueError(f"prefetch spec item {item!r}: {mb!r} is not a number of megabytes") from None
            if size < 0:
                raise ValueError(f"prefetch spec item {item!r}: negative size")
            out.append((name, size))
        else:
            raise ValueError(f"prefetch spec item {item!r}: expected o, gu:MB or down:MB")
    return out


def spec_from_env() -> str:
    return os.environ.get("NANOQWEN_DECODE_PREFETCH", DEFAULT_SPEC)


def _rows(w: Int4Weight, row0: int, rows: int) -> list[tuple[int, int]]:
    """(pointer, bytes) of rows [row0, row0 + rows) of a weight and of its scales, trimmed to 16 bytes."""
    out = []
    for a in (w.qweight, w.scales):
        per_row = int(a.nbytes) // int(a.shape[0])
        start = int(a.data.ptr) + row0 * per_row
        end = start + rows * per_row
        start, end = -(-start // 16) * 16, end // 16 * 16
        if end > start:
            out.append((start, end - start))
    return out


def layer_ranges(lw: GpuLayer, spec: list[tuple[str, float]], intermediate: int) -> list[tuple[int, int]]:
    """The (pointer, bytes) ranges of one layer's plan, in the order the kernels read them."""
    ranges: list[tuple[int, int]] = []
    for name, mb in spec:
        if name == "o":
            ranges += _rows(lw.o, 0, int(lw.o.qweight.shape[0]))
        elif name == "gu":
            w = lw.gate_up
            per_row = (int(w.qweight.nbytes) + int(w.scales.nbytes)) // int(w.qweight.shape[0])
            rows = min(intermediate, int(mb * _MB) // (2 * per_row) // 32 * 32)  # whole groups of 32
            if rows > 0:
                ranges += _rows(w, 0, rows) + _rows(w, intermediate, rows)  # gate rows, then up rows
        elif name == "down":
            w = lw.down
            per_row = (int(w.qweight.nbytes) + int(w.scales.nbytes)) // int(w.qweight.shape[0])
            rows = min(int(w.qweight.shape[0]), int(mb * _MB) // per_row // 2 * 2)
            if rows > 0:
                ranges += _rows(w, 0, rows)
    return ranges


def plan(ks: Any, layers: list[GpuLayer], intermediate: int, spec: str | None = None) -> list[Any]:
    """One nanoqwen_kernels.attention.L2Prefetch per layer (None per layer when the spec is empty)."""
    from nanoqwen_kernels.attention import l2_prefetch

    items = parse_spec(spec_from_env() if spec is None else spec)
    on_device = all(hasattr(getattr(lw.o.qweight, "data", None), "ptr") for lw in layers)
    if not items or not on_device:  # nothing asked, or host arrays (the CPU stand-in kernels)
        return [None] * len(layers)
    return [l2_prefetch(layer_ranges(lw, items, intermediate)) for lw in layers]
