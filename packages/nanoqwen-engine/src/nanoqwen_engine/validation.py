"""The validation ladder's reusable parts: a diverse prompt set and the greedy comparison of two engines.

Used by the ladder tests (tests/test_ladder_*.py) and `nanoqwen-cli verify`:

    prompts = build_prompts(engine.tokenizer, n=100)
    report = compare_greedy(gpu_engine, cpu_engine, prompts, max_tokens=64, eps=DEFAULT_EPS)
    print(format_report(report)); assert report.ok

Greedy decoding is a chain of argmaxes, so two correct engines that round differently (the GPU keeps
activations and the KV cache in fp16 and sums in a different order; the reference is float32 numpy) pick
the same token unless the reference's best two logits are closer than the rounding error. So a
divergence is acceptable only where the reference itself barely prefers its token over the one the other
engine picked: gap = ref_logit[ref_token] - ref_logit[other_token] <= eps (for a token that is the
reference's runner-up this gap is the reference's top-2 margin; a token further down is further away, so
this is stricter than asking for a small top-2 margin alone). Any other divergence is a bug.

DEFAULT_EPS = 0.1 logit: the error of a gap is the difference of two logits' errors. Measured with the
fp16-storage emulation of the GPU path (cuda/host_kernels.py) on a 28-layer synthetic model (logit std
6.1), score() logits differ from the float32 reference by 0.0086 median, 0.043 at the 99.9th percentile
and 0.071 at most over 30 x 152064 logits (rel 2.1e-3); a gap's error is then ~0.017 rms, so 0.1 is ~6
sigma of rounding noise, while random-weight models still show top-2 margins from 0.01 to 4 (so
near-ties do happen and must be judged, not assumed away). The GPU's own figures are in
docs/VALIDATION.md.

EPS["int8"]: with int8 decode activations (the GPU's default at batch 1: each GEMV input rounded to int8
with a scale per 16 values) the rounding is no longer 2^-11 of a value but up to 1/254 of its group's
largest, and on random-weight models it moves a top-2 gap by far more. scripts/int8_decode_noise.py
(teacher-forced decode) on the H200: 0.111 rms, 0.29 at the 99th percentile, 0.36 at most over 552
positions of the ladder's tiny model against the float32 reference (fp16 activations: 0.012 rms); 0.111
rms, 0.43 at most over 368 positions of the 7B-shaped model against its fp16 path. INT8_EPS = 0.7 is ~6
sigma of that, as 0.1 is for fp16. A trained model's logits are far less flat: on the real
Qwen2.5-Coder-1.5B int8 passes its tier against transformers at eps 0.1 (worst gap 0.044), which stays
that tier's bound.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib import resources

import numpy as np

DEFAULT_EPS = 0.1
INT8_EPS = 0.7
EPS = {"fp16": DEFAULT_EPS, "int8": INT8_EPS}  # by the engine's decode activations


def eps_for(engine) -> float:
    """The near-tie bound for an engine under test: EPS of its backend's decode activations (the CPU
    reference and fp16 GPU decode: DEFAULT_EPS)."""
    return EPS[getattr(engine.backend, "info", {}).get("decode_activations", "fp16")]
PAGE_BOUNDARY_LENGTHS = (15, 16, 17, 31, 32, 33)

# The built-in material lives in data/ladder_prompts.json: short, varied code in eight languages, prose
# (ASCII plus a little Unicode, as real prompts are) and chat conversations.
_MATERIAL = json.loads((resources.files(__package__) / "data" / "ladder_prompts.json").read_text(encoding="utf-8"))
_CODE: dict[str, str] = _MATERIAL["code"]
_PROSE: list[str] = _MATERIAL["prose"]
_CHAT: list[list[dict[str, str]]] = _MATERIAL["chat"]


@dataclass(frozen=True)
class Prompt:
    name: str  # e.g. "code-rust-07"
    kind: str  # "code" | "prose" | "chat" | "raw" | "boundary"
    text: str | None = None  # raw completion text (special-token markup parsed)
    messages: tuple | None = None  # chat messages (rendered with the model's chat template)
    n_tokens: int | None = None  # prompt length in tokens, once known

    @property
    def payload(self):
        return list(self.messages) if self.messages is not None else self.text


def corpus() -> str:
    """All the built-in code and prose, one text (long prompts are cut from it)."""
    return "\n\n".join([*_CODE.values(), *_PROSE])


def text_of_length(tokenizer, source: str, n: int) -> str:
    """A prefix-cut of `source` (repeated as needed) that encodes to exactly n tokens.

    Cutting the token ids and decoding may re-encode to a different count (a merge across the cut), so
    nearby cuts are tried; ValueError if none fits (never seen with ASCII-heavy sources).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ids = tokenizer.encode(source, parse_special=False)
    while len(ids) < n + 8:
        source = source + "\n" + source
        ids = tokenizer.encode(source, parse_special=False)
    for cut in [n, n + 1, n - 1, n + 2, n - 2, n + 3, n - 3]:
        if cut < 1:
            continue
        text = tokenizer.decode(ids[:cut])
        if len(tokenizer.encode(text, parse_special=False)) == n:
            return text
    raise ValueError(f"no prefix of the source encodes to exactly {n} tokens")


def prompt_lengths(n: int, max_tokens: int = 2000, seed: int = 0) -> list[int]:
    """n raw-prompt lengths: 1 and 2, the page-boundary lengths, max_tokens, and the rest log-uniform
    over [3, max_tokens] (most prompts are short; a few are long)."""
    fixed = [1, 2, *PAGE_BOUNDARY_LENGTHS, max_tokens]
    fixed = [x for x in fixed if x <= max_tokens][:n]
    rng = np.random.default_rng(seed)
    rest = np.exp(rng.uniform(np.log(3), np.log(max_tokens), size=max(0, n - len(fixed))))
    return fixed + [int(x) for x in rest]


def build_prompts(tokenizer, n: int = 100, max_tokens: int = 2000, seed: int = 0) -> list[Prompt]:
    """n diverse prompts: ~60% raw code/prose cut to exact token lengths (1..max_tokens, page boundaries
    included), ~20% whole code/prose snippets as raw completions, ~20% chat through the template."""
    n_chat = max(1, n // 5) if n >= 5 else 0
    n_whole = max(1, n // 5) if n >= 5 else 0
    n_cut = n - n_chat - n_whole
    out: list[Prompt] = []
    text_all = corpus()
    sources = [*_CODE.items(), *(("prose", p) for p in _PROSE)]
    for i, length in enumerate(prompt_lengths(n_cut, max_tokens, seed)):
        name, src = sources[i % len(sources)]
        # Long lengths take the whole corpus; every prompt starts at its own line of its source, so
        # two prompts of one source and length still differ.
        if length > 200:
            src = text_all
        lines = src.splitlines(keepends=True)
        k = (i * 7) % len(lines)
        text = text_of_length(tokenizer, "".join(lines[k:] + lines[:k]), length)
        kind = "boundary" if length in PAGE_BOUNDARY_LENGTHS else "raw"
        out.append(Prompt(f"{kind}-{name}-{length}-{i:02d}", kind, text=text, n_tokens=length))
    for i in range(n_whole):
        name, src = sources[i % len(sources)]
        kind = "prose" if name == "prose" else "code"
        # Distinct prompts: each takes a different starting line of its snippet.
        lines = src.splitlines(keepends=True)
        text = "".join(lines[(i // len(sources)) % max(1, len(lines) - 1):])
        out.append(Prompt(f"{kind}-{name}-{i:02d}", kind, text=text,
                          n_tokens=len(tokenizer.encode(text))))
    for i in range(n_chat):
        msgs = _CHAT[i % len(_CHAT)]
        if i >= len(_CHAT):  # vary the repeats so no two prompts are the same
            msgs = [*msgs[:-1], {"role": "user", "content": f"{msgs[-1]['content']} (variant {i})"}]
        out.append(Prompt(f"chat-{i:02d}", "chat", messages=tuple(msgs)))
    return out


# --- comparison ---------------------------------------------------------------------------------------
@dataclass
class PromptResult:
    name: str
    kind: str
    prompt_tokens: int
    tokens_a: list[int]
    tokens_b: list[int]
    matched: int  # length of the common prefix of the two generations
    divergence: int | None  # index of the first differing token; None when one is a prefix of the other
    ref_top2_margin: float | None = None  # engine_b's top-1 minus top-2 logit at the divergence
    ref_gap: float | None = None  # engine_b's logit of its token minus that of engine_a's token there
    ok: bool = True


@dataclass
class LadderReport:
    eps: float
    max_tokens: int
    results: list[PromptResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def n_exact(self) -> int:
        return sum(r.divergence is None for r in self.results)

    @property
    def n_near_tie(self) -> int:
        return sum(r.divergence is not None and r.ok for r in self.results)

    @property
    def n_bad(self) -> int:
        return sum(not r.ok for r in self.results)

    @property
    def match_fraction(self) -> float:
        tot = sum(max(len(r.tokens_a), len(r.tokens_b)) for r in self.results)
        return sum(r.matched for r in self.results) / max(1, tot)

    def as_dict(self) -> dict:
        return {"eps": self.eps, "max_tokens": self.max_tokens, "ok": self.ok, "n_prompts": len(self.results),
                "n_exact": self.n_exact, "n_near_tie": self.n_near_tie, "n_bad": self.n_bad,
                "match_fraction": self.match_fraction, "results": [asdict(r) for r in self.results]}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where a and b differ, None if one is a prefix of the other."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None


def margins_at(ref_logits: np.ndarray, ref_token: int, other_token: int) -> tuple[float, float]:
    """(top-1 minus top-2 logit, logit[ref_token] - logit[other_token]) of one float [V] row."""
    x = np.asarray(ref_logits, dtype=np.float64)
    top2 = np.partition(x, -2)[-2:]
    return float(top2[1] - top2[0]), float(x[ref_token] - x[other_token])


def judge(tokens_a: list[int], tokens_b: list[int], ref_logits_at, eps: float) -> tuple[int, int | None, float | None, float | None, bool]:
    """(matched, divergence, top2 margin, gap, ok) for two generations; ref_logits_at(i) -> engine_b's
    float [V] logits for generated position i (called only at a divergence)."""
    div = first_divergence(tokens_a, tokens_b)
    if div is None:
        return min(len(tokens_a), len(tokens_b)), None, None, None, True
    top2, gap = margins_at(ref_logits_at(div), tokens_b[div], tokens_a[div])
    return div, div, top2, gap, bool(gap <= eps)


def greedy_tokens(engine, payload, max_tokens: int) -> list[int]:
    from .params import SamplingParams

    return engine.complete(payload, SamplingParams(temperature=0, max_tokens=max_tokens)).token_ids


def _as_prompt(i: int, p) -> Prompt:
    if isinstance(p, Prompt):
        return p
    return Prompt(f"prompt-{i:03d}", "chat" if isinstance(p, list | tuple) else "raw",
                  text=p if isinstance(p, str) else None,
                  messages=tuple(p) if isinstance(p, list | tuple) else None)


_WORKER_ENGINE = None


def _worker_init(path: str, max_context: int) -> None:
    global _WORKER_ENGINE
    from .engine import Engine

    _WORKER_ENGINE = Engine.load(path, device="cpu", max_context=max_context, progress=False)


def _worker_greedy(job):
    payload, max_tokens = job
    return greedy_tokens(_WORKER_ENGINE, payload, max_tokens)


def reference_tokens_parallel(path, prompts, max_tokens: int, max_context: int, workers: int) -> list[list[int]]:
    """The CPU reference's greedy tokens for every prompt, from `workers` processes (one reference engine
    each, one BLAS thread each): the reference is the slow side of the ladder, and prompts are independent.
    Processes are spawned (never forked: the parent may hold a CUDA context)."""
    import multiprocessing as mp
    import os
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(_as_prompt(i, p).payload, max_tokens) for i, p in enumerate(prompts)]
    saved = {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ.update({k: "1" for k in saved})  # read by numpy at import, in the children
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"),
                                 initializer=_worker_init, initargs=(str(path), max_context)) as ex:
            return list(ex.map(_worker_greedy, jobs))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def compare_greedy(engine_a, engine_b, prompts, max_tokens: int = 64, eps: float = DEFAULT_EPS,
                   progress=None, tokens_b: list[list[int]] | None = None) -> LadderReport:
    """Greedy generations of engine_a (under test) against engine_b (the reference) on every prompt.

    prompts: Prompt objects, strings (raw) or message lists (chat). progress(i, result), if given, is
    called after each prompt. tokens_b: engine_b's generations when already computed (e.g. by
    reference_tokens_parallel). At a divergence, engine_b.score(prompt + its own tokens so far) gives the
    reference logits whose margins decide whether the divergence is a near-tie (see the module doc).
    """
    rep = LadderReport(eps=eps, max_tokens=max_tokens)
    for i, p in enumerate(prompts):
        p = _as_prompt(i, p)
        ids = engine_b.encode_prompt(p.payload)
        ta = greedy_tokens(engine_a, p.payload, max_tokens)
        tb = tokens_b[i] if tokens_b is not None else greedy_tokens(engine_b, p.payload, max_tokens)

        def ref_logits_at(j, ids=ids, tb=tb):
            return engine_b.score(np.asarray(ids + tb[:j], dtype=np.int64))[-1]

        matched, div, top2, gap, ok = judge(ta, tb, ref_logits_at, eps)
        r = PromptResult(p.name, p.kind, len(ids), ta, tb, matched, div, top2, gap, ok)
        rep.results.append(r)
        if progress is not None:
            progress(i, r)
    return rep


def logit_error(a: np.ndarray, b: np.ndarray) -> dict:
    """score() comparison: relative Frobenius error, max abs error, argmax agreement of [T, V] logits."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return {
        "rel": float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), 1e-30)),
        "max_abs": float(np.max(np.abs(a - b))),
        "argmax_agree": float(np.mean(np.argmax(a, -1) == np.argmax(b, -1))),
        "finite": bool(np.isfinite(a).all()),
    }


def format_report(rep: LadderReport, limit: int = 20) -> str:
    """A short table: one line per diverging prompt (up to limit), then the totals."""
    lines = [f"{'prompt':34s} {'len':>5s} {'match':>9s} {'div':>4s} {'top2':>7s} {'gap':>7s}  verdict"]
    shown = [r for r in rep.results if r.divergence is not None][:limit]
    for r in shown:
        n = max(len(r.tokens_a), len(r.tokens_b))
        lines.append(f"{r.name[:34]:34s} {r.prompt_tokens:5d} {r.matched:4d}/{n:<4d} {r.divergence:4d} "
                     f"{r.ref_top2_margin:7.3f} {r.ref_gap:7.3f}  {'near-tie' if r.ok else 'BUG'}")
    lines.append(f"{len(rep.results)} prompts x {rep.max_tokens} tokens: {rep.n_exact} identical, "
                 f"{rep.n_near_tie} near-tie divergences (gap <= {rep.eps}), {rep.n_bad} bad; "
                 f"{100 * rep.match_fraction:.1f}% of tokens match")
    return "\n".join(lines)
