"""How far int8 decode activations move a random-weight model's logits from the float32 reference, on the CPU.

The validation ladder accepts a greedy divergence between the GPU and the CPU reference only where the
reference's gap between the two tokens is within eps (nanoqwen_engine.validation). eps must exceed the
noise that the GPU's own rounding puts on such a gap, and no more. This measures that noise for each decode
activation mode with the GPU path's numpy stand-ins (cuda/host_kernels.py: fp16 storage, and for int8 the
per-16 rounding of a single sequence's GEMV inputs, bit for bit as the kernels round): every prompt is
prefilled, then decoded teacher-forced on the reference's own greedy tokens, and at every decode position
the error of the reference's top-2 gap, (d[top1] - d[top2]) with d = stand-in logits - reference logits,
is collected. Printed per mode: that error's rms and largest value and the logits' own spread.

    python3 scripts/int8_decode_noise.py [--model tiny|PATH] [--prompts 24] [--tokens 24] [--json out.json]

No GPU needed. The default model is the ladder's tiny one (hidden 256, 4 layers, vocab 152064), written
under /tmp when missing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np


def teacher_forced(be, ids, toks, greedy, vocab) -> list[np.ndarray]:
    """Prefill ids, then decode toks[:-1] one by one (each the reference's token); the logits after each."""
    from nanoqwen_engine.sampler import SamplerState

    seq = be.pool.new_sequence()
    st = SamplerState(greedy, vocab)
    be.prefill(seq, np.asarray(ids), st)
    out = []
    for t in toks[:-1]:
        be.decode([seq], [t], [st])
        out.append(be.last_logits()[0].astype(np.float64))
    be.pool.free(seq)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", choices=["host", "cuda"], default="host",
                    help="host: the numpy stand-ins of the GPU path; cuda: the GPU itself")
    ap.add_argument("--reference", choices=["cpu", "fp16"], default="cpu",
                    help="cpu: the float32 reference backend; fp16: the same device's fp16-activation path "
                         "(for models whose CPU reference is too slow: its own noise is ~1/15 of int8's)")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--max-prompt-tokens", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tests"))
    from ladder.models import tiny_model
    from nanoqwen_engine.config import ModelConfig
    from nanoqwen_engine.cuda import CudaBackend
    from nanoqwen_engine.cuda.load import decode_activations_plan
    from nanoqwen_engine.params import SamplingParams
    from nanoqwen_engine.reference import ReferenceBackend
    from nanoqwen_engine.sampler import SamplerState
    from nanoqwen_engine.tokenizer import Tokenizer
    from nanoqwen_engine.validation import build_prompts
    from nanoqwen_format import open_model

    path = tiny_model(Path(tempfile.gettempdir())) if args.model == "tiny" else Path(args.model)
    nq = open_model(path)
    cfg = ModelConfig.from_hf(nq.config, nq.generation_config)
    tok = Tokenizer(nq.tokenizer_json, nq.tokenizer_config)
    prompts = build_prompts(tok, n=args.prompts, max_tokens=args.max_prompt_tokens)
    greedy = SamplingParams(temperature=0).resolve({})
    ctx = args.max_prompt_tokens + args.tokens + 16

    def backend(activations: str):
        kw = {"decode_activations": activations}
        if args.device == "host":
            from nanoqwen_engine.cuda.device import HostDevice
            from nanoqwen_engine.cuda.host_kernels import HostKernels

            dev = HostDevice()
            variant = decode_activations_plan(activations, None)[1]  # the variant the GPU would build
            kw.update(device=dev, kernels=HostKernels(cfg, dev, variant))
        return CudaBackend.create(nq, cfg, max_context=ctx, progress=False, **kw)

    modes = {"int8": backend("int8")}
    if args.reference == "cpu":
        modes = {"fp16": backend("fp16"), **modes}
        ref = ReferenceBackend.create(nq, cfg, max_context=ctx)
    else:
        ref = backend("fp16")
    errs: dict[str, list[float]] = {m: [] for m in modes}
    spread = []
    for i, p in enumerate(prompts):
        text = p.text if p.messages is None else tok.apply_chat_template(list(p.messages))
        ids = tok.encode(text)[: args.max_prompt_tokens]
        # the reference's greedy tokens and its logits after each decode input (it decodes them itself)
        seq = ref.pool.new_sequence()
        st = SamplerState(greedy, cfg.vocab)
        toks = [ref.prefill(seq, np.asarray(ids), st)]
        want = []
        for _ in range(args.tokens - 1):
            toks.append(ref.decode([seq], [toks[-1]], [st])[0])
            want.append(ref.last_logits()[0].astype(np.float64))
        ref.pool.free(seq)
        for name, be in modes.items():
            for got, w in zip(teacher_forced(be, ids, toks, greedy, cfg.vocab), want, strict=True):
                top = np.argsort(w)[-2:]
                d = got - w
                errs[name].append(float(d[top[1]] - d[top[0]]))
                if name == "int8":
                    spread.append(float(w.std()))
        print(f"[{i + 1}/{len(prompts)}] {p.name}: " + ", ".join(
            f"{m} gap err rms {np.sqrt(np.mean(np.square(e))):.4f}" for m, e in errs.items()), flush=True)
    summary = {"model": str(path), "device": args.device, "reference": args.reference,
               "prompts": len(prompts), "tokens": args.tokens, "logit_std_median": float(np.median(spread))}
    for m, e in errs.items():
        a = np.abs(np.asarray(e))
        summary[m] = {"positions": len(e), "gap_err_rms": float(np.sqrt(np.mean(a * a))),
                      "gap_err_p99": float(np.percentile(a, 99)), "gap_err_max": float(a.max())}
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
