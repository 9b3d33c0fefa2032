"""Load generator for `nanoqwen-cli serve` (or any OpenAI-compatible server): the official `openai` async
client at several concurrency levels, a fixed number of streamed requests per level, prompts of mixed
lengths.

    nanoqwen-cli serve --model qwen1.5b.nanoqwen &                   # wait for GET /health -> 200
    python3 scripts/load_openai.py --concurrency 1,8,32,64 --requests 256 --out docs/perf/serve-load.json

Per level it prints requests/s, output tokens/s (completion tokens the server counted, over the level's
wall time), time to first token (request sent -> first chunk with text) and inter-token latency (gaps
between consecutive text chunks of one request, all requests pooled) at p50 and p99, and TPOT (per
request: (last chunk - first chunk) / (completion tokens - 1), mean over requests), the figure to set
against `nanoqwen-cli bench`'s ms/token at concurrency 1:

    python3 scripts/load_openai.py --concurrency 1 --requests 8 --prompt-tokens 512 --max-tokens 128

Prompts are random code-like lines, drawn per request from --seed, sized by a word count that
approximates --prompt-tokens (the server's usage.prompt_tokens gives the true count, reported as the
mean). --ignore-eos (default on; vLLM's extension) makes every request generate exactly --max-tokens, so
levels are comparable; sampling is greedy unless --temperature says otherwise. Requests that fail are
counted by error and left out of the latencies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

WORDS = ("def", "return", "self", "value", "index", "for", "in", "range", "if", "else", "None", "list",
         "dict", "append", "result", "count", "item", "key", "total", "while", "break", "lambda", "import",
         "class", "yield", "async", "await", "with", "open", "path")


def make_prompt(rng: random.Random, tokens: int) -> str:
    """Code-like text of about `tokens` tokens (BPE gives ~1.3 tokens per word of this vocabulary with its
    punctuation), one random line after another."""
    lines, n = [], 0
    while n < tokens:
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 10))]
        line = f"{' '.join(words)}_{rng.randint(0, 999)}({rng.randint(0, 99)}):"
        lines.append(line)
        n += int(len(words) * 1.3) + 5
    return "\n".join(lines) + "\n"


@dataclass
class Result:
    ok: bool
    error: str = ""
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    tpot: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency: float = 0.0


async def one_request(client, args, prompt: str) -> Result:
    t0 = time.perf_counter()
    extra = {"ignore_eos": True} if args.ignore_eos else {}
    try:
        stream = await client.completions.create(
            model=args.model, prompt=prompt, max_tokens=args.max_tokens, temperature=args.temperature,
            stream=True, stream_options={"include_usage": True}, extra_body=extra)
        times, usage = [], None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                times.append(time.perf_counter())
            if chunk.usage is not None:
                usage = chunk.usage
    except Exception as e:  # noqa: BLE001 - every failure is a counted outcome of the load test
        return Result(False, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160])
    if not times or usage is None:
        return Result(False, error="no text or no usage in the stream")
    r = Result(True, ttft=times[0] - t0, gaps=[b - a for a, b in zip(times, times[1:], strict=False)],
               prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
               latency=times[-1] - t0)
    if usage.completion_tokens > 1:
        r.tpot = (times[-1] - times[0]) / (usage.completion_tokens - 1)
    return r


async def run_level(client, args, concurrency: int, prompts: list[str]) -> dict:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[Result] = []

    async def worker():
        while True:
            try:
                prompt = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await one_request(client, args, prompt))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return summarize(concurrency, results, wall)


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))
    return s[k]


def summarize(concurrency: int, results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    ttft = [r.ttft for r in ok]
    gaps = [g for r in ok for g in r.gaps]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    out_tokens = sum(r.completion_tokens for r in ok)
    ms = lambda x: None if x is None else round(1000 * x, 3)  # noqa: E731
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "ok": len(ok),
        "errors": errors,
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(ok) / wall, 3),
        "output_tok_per_s": round(out_tokens / wall, 1),
        "mean_prompt_tokens": round(sum(r.prompt_tokens for r in ok) / len(ok), 1) if ok else None,
        "mean_completion_tokens": round(out_tokens / len(ok), 1) if ok else None,
        "ttft_ms_p50": ms(percentile(ttft, 50)),
        "ttft_ms_p99": ms(percentile(ttft, 99)),
        "itl_ms_p50": ms(percentile(gaps, 50)),
        "itl_ms_p99": ms(percentile(gaps, 99)),
        "tpot_ms_mean": ms(sum(tpot) / len(tpot)) if tpot else None,
        "latency_ms_p50": ms(percentile([r.latency for r in ok], 50)),
        "latency_ms_p99": ms(percentile([r.latency for r in ok], 99)),
    }


def print_table(rows: list[dict]) -> None:
    head = ("conc", "ok/req", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "TPOT",
            "prompt")
    print(" ".join(f"{h:>10}" for h in head))
    for r in rows:
        cells = (r["concurrency"], f"{r['ok']}/{r['requests']}", r["requests_per_s"], r["output_tok_per_s"],
                 r["ttft_ms_p50"], r["ttft_ms_p99"], r["itl_ms_p50"], r["itl_ms_p99"], r["tpot_ms_mean"],
                 r["mean_prompt_tokens"])
        print(" ".join(f"{'-' if c is None else c:>10}" for c in cells))
        for err, n in r["errors"].items():
            print(f"    {n} x {err}")
    print("(latencies in ms; ITL: gaps between text chunks; TPOT: per-request mean time per output token)")


async def main_async(args) -> list[dict]:
    import openai

    client = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0,
                                timeout=args.timeout)
    if args.model is None:
        models = await client.models.list()
        args.model = models.data[0].id
    rng = random.Random(args.seed)
    lengths = [int(x) for x in args.prompt_tokens.split(",")]
    rows = []
    try:
        if args.warmup:
            await run_level(client, args, 1, [make_prompt(rng, lengths[0]) for _ in range(args.warmup)])
        for conc in (int(c) for c in args.concurrency.split(",")):
            prompts = [make_prompt(rng, lengths[i % len(lengths)]) for i in range(args.requests)]
            rng.shuffle(prompts)
            rows.append(await run_level(client, args, conc, prompts))
            print(f"concurrency {conc}: {rows[-1]['ok']}/{rows[-1]['requests']} ok in {rows[-1]['wall_s']} s",
                  file=sys.stderr)
    finally:
        await client.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default=os.environ.get("NANOQWEN_API_KEY", "none"))
    ap.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    ap.add_argument("--concurrency", default="1,8,32,64", help="comma-separated levels, run in order")
    ap.add_argument("--requests", type=int, default=128, help="requests per level")
    ap.add_argument("--prompt-tokens", default="64,256,1024",
                    help="approximate prompt lengths, cycled over the requests of a level (mixed lengths)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--warmup", type=int, default=2, help="requests at concurrency 1 before the levels")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--json", action="store_true", help="print one JSON record instead of the table")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON record here")
    args = ap.parse_args()
    rows = asyncio.run(main_async(args))
    record = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "levels": rows}
    if args.json:
        print(json.dumps(record))
    else:
        print_table(rows)
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0 if all(r["ok"] == r["requests"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
