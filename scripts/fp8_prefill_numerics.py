"""What FP8 (e4m3) activations in the prefill GEMMs would do to a real model's logits, on the CPU.

The question behind it (issue 16): the prefill lines of 10 ms for a 512-token 7B prompt and 150 ms for 8k sit
below what fp16 tensor cores can do (the GEMMs alone take ~9.5 ms and ~158 ms at cuBLAS's fp16 rate). FP8
tensor cores run at twice the rate. The INT4 weights are integers -8..7 times a group scale, and those
integers are exact in e4m3, so an FP8 GEMM can keep the weights exact (the group scale applied to each
group's fp32 partial sum); the only new rounding is the activations' (X of every GEMM rounded to e4m3 after
dividing by a scale). This script measures that rounding's effect with the numpy reference backend: every
prefill GEMM's X is rounded as the kernel would round it, and the logits at every position of real text are
compared with the unrounded reference (float32 activations) and with fp16 activations (what the GPU's fp16
GEMMs see: the noise floor we already accept).

    python scripts/fp8_prefill_numerics.py MODEL.nanoqwen [--windows 4 --window 256] [--json]

Variants: fp16 (X rounded to fp16), fp8-token (one scale per token row: amax / 448), fp8-g128 (one scale per
128 columns of a token row, the INT4 group size), and for decode's int8-activation GEMVs (issue 15,
`decode_activations="int8"`) int8-gG, e.g. int8-g16 / int8-g32 (X rounded to fp16, then to int8 with one
scale per G columns, amax / 127; int8-g16 is what nanoqwen_kernels.a8.round_a8 does, g32 what it did
before the twentieth lease): those round every row, so every position is
scored as if each token had been decoded with rounded activations (teacher-forced). Reported per variant against the float32 reference: top-1
agreement over all positions, mean and max KL(ref || variant), the perplexity of the text, and the real tier's
criterion (where the argmaxes differ, the reference's logit gap to the variant's pick; the tier allows 0.1).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

E4M3_MAX = 448.0


def round_e4m3(y: np.ndarray) -> np.ndarray:
    """float32 -> nearest e4m3 value (ties to even), saturating at +-448: 3 mantissa bits, exponents -6..8,
    subnormals in steps of 2^-9 below 2^-6."""
    a = np.abs(y).astype(np.float32)
    _, ex = np.frexp(a)  # a = m 2^ex, m in [0.5, 1): the binade's exponent is ex - 1
    e = np.maximum(ex.astype(np.int32) - 1, -6)
    step = np.ldexp(np.float32(1.0), e - 3).astype(np.float32)
    r = np.minimum(np.rint(a / step) * step, E4M3_MAX)
    return np.copysign(r, y).astype(np.float32)


def quantize_rows(x: np.ndarray, mode: str) -> np.ndarray:
    """x [T, K] float32 -> what an FP8 GEMM multiplies: e4m3(x / s) * s."""
    if mode == "fp16":
        return x.astype(np.float16).astype(np.float32)
    if mode == "fp8-token":
        s = np.abs(x).max(axis=1, keepdims=True) / E4M3_MAX
        s = np.where(s > 0, s, 1.0).astype(np.float32)
        return round_e4m3(x / s) * s
    if mode == "fp8-g128":
        T, K = x.shape
        g = x.reshape(T, K // 128, 128)
        s = np.abs(g).max(axis=2, keepdims=True) / E4M3_MAX
        s = np.where(s > 0, s, 1.0).astype(np.float32)
        return (round_e4m3(g / s) * s).reshape(T, K)
    if mode.startswith("int8-g"):  # decode's W4A8 GEMVs: x rounded to fp16, then int8 per group of G columns
        T, K = x.shape
        G = int(mode[len("int8-g"):])
        g = x.astype(np.float16).astype(np.float32).reshape(T, K // G, G)
        amax = np.abs(g).max(axis=2, keepdims=True)
        inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
        q = np.clip(np.rint(g * inv), -127, 127)
        return (q * (amax / np.float32(127.0))).astype(np.float32).reshape(T, K)
    raise ValueError(mode)


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def text_ids(engine, n_tokens: int) -> np.ndarray:
    """Real code as the test text: this repository's own Python sources, concatenated."""
    root = pathlib.Path(__file__).resolve().parent.parent
    text = "\n\n".join(p.read_text() for p in sorted(root.glob("packages/*/src/**/*.py")))
    ids = engine.tokenizer.encode(text)
    return np.asarray(ids[:n_tokens], dtype=np.int64)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--variants", default="fp16,fp8-token,fp8-g128")
    ap.add_argument("--families", default="all",
                    help="which GEMMs round X: all, or a comma list of qkv, o, gate_up, down (the rest stay float32)")
    ap.add_argument("--continuation", type=int, default=0,
                    help="also: prefill each window's first (window - N) tokens with rounded X, then score its last "
                         "N tokens with float32 GEMMs (teacher-forced, as decode would see them): what a user "
                         "of FP8 prefill gets, the prompt's K/V and first token rounded, the rest not")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from nanoqwen_engine import Engine
    from nanoqwen_engine.reference import backend as ref

    engine = Engine.load(args.model, device="cpu", max_context=args.window, progress=False)
    ids = text_ids(engine, args.windows * args.window)
    windows = [ids[i : i + args.window] for i in range(0, len(ids), args.window)]
    exact_linear = ref.linear

    # the reference's layer calls linear 7 times, in this order (backend.forward)
    order = ["qkv", "qkv", "qkv", "o", "gate_up", "gate_up", "down"]
    families = set(order) if args.families == "all" else set(args.families.split(","))
    if not families <= set(order):
        ap.error(f"--families: choose from {sorted(set(order))}")

    def scored(mode: str | None) -> list[np.ndarray]:
        calls = [0]

        def linear(x, w):
            fam = order[calls[0] % len(order)]
            calls[0] += 1
            rounded = fam in families and (x.shape[0] > 1 or mode.startswith("int8"))
            return exact_linear(quantize_rows(x, mode) if rounded else x, w)

        ref.linear = exact_linear if mode is None else linear
        try:
            return [log_softmax(engine.score(w)) for w in windows]
        finally:
            ref.linear = exact_linear

    def continued(mode: str | None, n: int) -> list[np.ndarray]:
        """log-softmax rows of each window's last n positions after a rounded prefill of the rest."""
        calls = [0]

        def linear(x, w):
            fam = order[calls[0] % len(order)]
            calls[0] += 1
            return exact_linear(quantize_rows(x, mode) if fam in families else x, w)

        be = engine.backend
        out = []
        for w in windows:
            seq = be.pool.new_sequence()
            try:
                ref.linear = exact_linear if mode is None else linear
                be.forward([(seq, w[:-n])], all_logits=False)
                ref.linear = exact_linear
                out.append(log_softmax(be.forward([(seq, w[-n:])], all_logits=True)))
            finally:
                ref.linear = exact_linear
                be.pool.free(seq)
        return out

    t0 = time.perf_counter()
    if args.continuation:
        n = args.continuation
        base_c = continued(None, n)
        for mode in args.variants.split(","):
            got = continued(mode, n)
            top1 = np.mean(np.concatenate([b.argmax(-1) == g.argmax(-1) for b, g in zip(base_c, got, strict=True)]))
            kl = np.concatenate([(np.exp(b) * (b - g)).sum(-1) for b, g in zip(base_c, got, strict=True)])
            print(f"continuation ({n} tokens after a rounded prefill) {mode}: top-1 agree {top1:.4f}, "
                  f"KL mean {kl.mean():.2e} max {kl.max():.2e}", flush=True)
    base = scored(None)
    results = {}
    for mode in args.variants.split(","):
        got = scored(mode)
        top1 = np.mean(np.concatenate([b.argmax(-1) == g.argmax(-1) for b, g in zip(base, got, strict=True)]))
        kl = np.concatenate([(np.exp(b) * (b - g)).sum(-1) for b, g in zip(base, got, strict=True)])
        nll = np.concatenate([-g[np.arange(len(w) - 1), w[1:]] for g, w in zip(got, windows, strict=True)])
        # the real tier's criterion (scripts/real_vs_transformers.py): where the argmaxes differ, how far the
        # variant's pick is below the reference's in the reference's logits (a near-tie is <= 0.1)
        gaps = np.concatenate([b.max(-1) - b[np.arange(len(b)), g.argmax(-1)] for b, g in zip(base, got, strict=True)])
        results[mode] = {"top1_agree": float(top1), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                         "ppl": float(np.exp(nll.mean())), "worst_gap": float(gaps.max()),
                         "gaps_over_0.1": int((gaps > 0.1).sum())}
    nll0 = np.concatenate([-b[np.arange(len(w) - 1), w[1:]] for b, w in zip(base, windows, strict=True)])
    results["fp32"] = {"ppl": float(np.exp(nll0.mean())), "positions": int(sum(len(w) for w in windows))}
    results["seconds"] = time.perf_counter() - t0
    engine.close()
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(f"reference (float32 activations): ppl {results['fp32']['ppl']:.4f} over "
              f"{results['fp32']['positions']} positions")
        print(f"{'variant':<10} {'top-1 agree':>12} {'KL mean':>10} {'KL max':>10} {'ppl':>9} {'worst gap':>10} "
              f"{'gaps > 0.1':>10}")
        for mode in args.variants.split(","):
            r = results[mode]
            print(f"{mode:<10} {r['top1_agree']:>12.4f} {r['kl_mean']:>10.2e} {r['kl_max']:>10.2e} {r['ppl']:>9.4f} "
                  f"{r['worst_gap']:>10.4f} {r['gaps_over_0.1']:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
