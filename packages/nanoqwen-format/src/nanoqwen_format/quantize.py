"""Symmetric group-wise INT4 quantization: the encoders behind the decode contract of docs/FORMAT.md
section 5 (w' = s * q, q in -8..7, one float16 scale s per 128 values along K).

The contract fixes only how (u, s) decode. How s is chosen is the encoder's business; given s, every
encoder here takes the nearest level, q = clamp(rint(w / s), -8, 7) in float32 (q = 0 where s == 0),
which is the best q for that s element by element. The methods differ in the scale (a = max|w| and m the
group's value of largest magnitude, sign included):

  max-exact      (the default) of s = float16(a / 7) and s = float16(m / -8), the one of least squared
                 error sum_j (w_j - s q_j)^2. Both reproduce m exactly (up to the scale's fp16 rounding).
  rtn            s = float16(a / 7). The level -8 is reached only by rounding of tiny groups.
  signed         s = float16(m / -8) (llama.cpp's Q4_0): m lands exactly on q = -8, so its side of zero
                 gets 8 levels, the other side 7. s is negative when m is positive (the contract allows
                 any finite float16).
  search         the s of least squared error among float16(a / d), d in SEARCH_DIVISORS, then LS_STEPS
                 least-squares refinements.
  signed-search  the same over float16(a / 7) and float16(m / -d), d in SIGNED_DIVISORS.

The two searches may clip m (d > 7.5 or 8) to refine the other values' steps: they have the least
squared weight error and the worst perplexity on the real Qwen2.5-Coder-1.5B (docs/QUANT.md). A group's
largest weights matter more than their share of the squared error; max-exact never moves them.

A least-squares refinement takes the best candidate's q, sets s' = float16(<w, q> / <q, q>) (the scale
that minimises the error for those q), requantizes with s' and keeps it if the error went down.

Every method but signed has the rtn scale among its candidates and keeps another only if its float32
error is strictly lower, so per group its error is never above rtn's. All arithmetic is float32.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .errors import NanoqwenFormatError

GROUP = 128  # values per scale, along K (the input dimension)
QMIN, QMAX = -8, 7
ZERO = 8  # stored u = q + ZERO

METHODS = ("max-exact", "rtn", "signed", "search", "signed-search")
DEFAULT_METHOD = "max-exact"
SEARCHES = ("max-exact", "search", "signed-search")  # the methods that compare candidates by their error
RTN_DIVISOR = 7.0
# Divisors of the candidate scales. signed-search: s = m / -d puts m at q = -d, rounded; d > 8 clips m
# to -8 in exchange for finer steps for the rest of the group. search: s = max|w| / d, d > 7.5 clips.
SIGNED_DIVISORS = (7.0, 7.25, 7.5, 7.75, 8.0, 8.25, 8.5)
SEARCH_DIVISORS = (7.0, 7.25, 7.5, 7.75, 8.0, 8.25, 8.5, 8.75, 9.0)
LS_STEPS = 2
# Groups per work item: 2048 x 128 float32 = 1 MiB, so one candidate's passes over a block stay in cache.
BLOCK_GROUPS = 2048
THREADS = max(1, min(8, os.cpu_count() or 1))  # numpy's element-wise loops release the GIL


def quantize_int4(w: np.ndarray, method: str = DEFAULT_METHOD,
                  importance: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """w float [N, K] (K % 128 == 0) -> (u uint8 [N, K] in 0..15, scales float16 [N, K/128]).

    importance: optional float [K] >= 0, a weight per input column (say E[x_k^2] of the layer's input on
    calibration text); the search encoders then minimise sum_j importance_j (w_j - s q_j)^2, the expected
    squared error of the layer's output when inputs are uncorrelated.
    """
    if method not in METHODS:
        raise NanoqwenFormatError(f"unknown quantizer {method!r} (one of {', '.join(METHODS)})")
    w = np.asarray(w)
    if w.ndim != 2 or w.shape[1] % GROUP != 0:
        raise NanoqwenFormatError(f"quantize_int4 needs a 2-D [N, K] array with K a multiple of {GROUP}, "
                                  f"got shape {w.shape}")
    if not np.issubdtype(w.dtype, np.floating):
        raise NanoqwenFormatError(f"quantize_int4 needs floating-point weights, got {w.dtype}")
    n, k = w.shape
    imp = None
    if importance is not None:
        if method not in SEARCHES:
            raise NanoqwenFormatError(f"importance weights apply to the search encoders, not {method!r}")
        imp = np.asarray(importance, dtype=np.float32)
        if imp.shape != (k,) or not np.all(np.isfinite(imp)) or np.any(imp < 0):
            raise NanoqwenFormatError(f"importance must be {k} finite values >= 0, got shape {imp.shape}")
        imp = imp.reshape(k // GROUP, GROUP)
    g = np.ascontiguousarray(w, dtype=np.float32).reshape(n * (k // GROUP), GROUP)  # [G, 128]
    u = np.empty(g.shape, dtype=np.uint8)
    scales = np.empty(g.shape[0], dtype=np.float16)
    blocks = [(a, min(a + BLOCK_GROUPS, g.shape[0])) for a in range(0, g.shape[0], BLOCK_GROUPS)]

    def work(ab):
        a, b = ab
        # group i of g is column group i % (K/128) of its row
        wt = None if imp is None else imp[np.arange(a, b) % (k // GROUP)]
        scales[a:b], u[a:b] = _encode(g[a:b], method, wt)

    if len(blocks) > 1 and THREADS > 1:
        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(work, blocks))  # list(): re-raises a worker's exception here
    else:
        for ab in blocks:
            work(ab)
    return u.reshape(n, k), scales.reshape(n, k // GROUP)


def _encode(g: np.ndarray, method: str, wt: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """g float32 [G, 128] (wt: its importance, float32 [G, 128], or None) -> (scales f16 [G], u uint8 [G, 128])."""
    gmax, gmin = g.max(axis=1), g.min(axis=1)
    amax = np.maximum(gmax, -gmin)  # max|w| without a |g| temporary
    if not np.all(np.isfinite(amax)):
        raise NanoqwenFormatError("quantize_int4: weights contain inf or NaN")
    with np.errstate(over="ignore"):
        rtn = (amax / np.float32(RTN_DIVISOR)).astype(np.float16)
    # Every method refuses the same weights: the rtn scale must be finite (it is a candidate of each search).
    if not np.all(np.isfinite(rtn)):
        raise NanoqwenFormatError("quantize_int4: a group's max|w|/7 overflows float16 (|w| > 458528)")
    m = np.where(gmax >= -gmin, gmax, gmin)  # the signed value of largest magnitude (+a on a tie)
    work = np.empty_like(g)
    if method == "rtn":
        best = rtn
    elif method == "signed":
        best = _scale16(m / np.float32(-8.0))
    else:
        if method == "max-exact":
            cands, ls_steps = [_scale16(m / np.float32(-8.0))], 0  # refinement would move m off its level
        elif method == "search":
            cands, ls_steps = [_scale16(amax / np.float32(d)) for d in SEARCH_DIVISORS], LS_STEPS
        else:
            cands, ls_steps = [_scale16(m / np.float32(-d)) for d in SIGNED_DIVISORS], LS_STEPS
        best, best_err = rtn, _sq_error(g, rtn, work, wt)
        for s in cands:
            best, best_err = _keep_better(g, best, best_err, s, work, wt)
        gw = g if wt is None else g * wt
        for _ in range(ls_steps):
            _levels(g, best, work)  # work = q of the best scale so far
            num = np.einsum("ij,ij->i", gw, work)
            den = np.einsum("ij,ij->i", work, work if wt is None else work * wt)
            with np.errstate(divide="ignore", invalid="ignore"):
                refined = _scale16(np.where(den > 0, num / den, best.astype(np.float32)))
            best, best_err = _keep_better(g, best, best_err, refined, work, wt)
    best = np.where(best == 0, np.float16(0), best)  # -0.0 -> +0.0: one spelling of "no scale"
    _levels(g, best, work)
    work += np.float32(ZERO)
    return best, work.astype(np.uint8)


def _scale16(s: np.ndarray) -> np.ndarray:
    """float32 candidate scales -> float16; one that overflows (or is NaN) becomes inf, never chosen."""
    with np.errstate(over="ignore", invalid="ignore"):
        s16 = s.astype(np.float16)
    return np.where(np.isnan(s16), np.float16(np.inf), s16)


def _levels(g: np.ndarray, s16: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = clamp(rint(g / s), -8, 7) as float32, q = 0 where s == 0."""
    # s == 0 -> divide by +inf: every finite w/inf is +-0, so q = 0 without a separate select pass.
    s = s16.astype(np.float32)
    s = np.where(s == 0, np.float32(np.inf), s)[:, None]
    np.divide(g, s, out=out)
    np.rint(out, out=out)
    np.clip(out, QMIN, QMAX, out=out)
    return out


def _sq_error(g: np.ndarray, s16: np.ndarray, work: np.ndarray, wt: np.ndarray | None) -> np.ndarray:
    """sum_j wt_j (g_j - s q_j)^2 per group (wt = 1 when None), float32 [G]; inf where s is not finite."""
    finite = np.isfinite(s16)
    s = np.where(finite, s16, np.float16(0))
    _levels(g, s, work)
    work *= s.astype(np.float32)[:, None]
    np.subtract(g, work, out=work)
    err = np.einsum("ij,ij->i", work, work if wt is None else work * wt)
    return np.where(finite, err, np.float32(np.inf))


def _keep_better(g, best, best_err, cand, work, wt):
    err = _sq_error(g, cand, work, wt)
    better = err < best_err
    return np.where(better, cand, best), np.where(better, err, best_err)


def dequantize_int4(u: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """u uint8 [N, K] (0..15), scales float16 [N, K/128] -> float32 [N, K] = s * (u - 8)."""
    n, k = u.shape
    if scales.shape != (n, k // GROUP) or k % GROUP:
        raise NanoqwenFormatError(f"dequantize_int4: scales shape {scales.shape} does not fit values {u.shape}")
    q = u.reshape(n, k // GROUP, GROUP).astype(np.float32) - np.float32(ZERO)
    return (q * scales.astype(np.float32)[:, :, None]).reshape(n, k)
