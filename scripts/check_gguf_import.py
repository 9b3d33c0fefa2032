"""Check nanoqwen's GGUF import against an independent reader: Hugging Face transformers loading the same
GGUF through its own GGUF support (its qwen2 name map and q/k handling, gguf's dequantizers).

  1. every tensor: nanoqwen_format.gguf_import's name map and row reads vs transformers' state dict
     (must be bit-equal: same names, shapes, values; no q/k permutation on either side for qwen2);
  2. the perplexity of a text under the GGUF's own (dequantized, fp32) weights, on the ids of the shipped
     tokenizer: the reference value of the real-model CPU tier (tests/test_real_model_cpu.py, PPL_SOURCE).

    python scripts/check_gguf_import.py MODEL.gguf [TEXT] [--json OUT]

Needs torch, transformers and accelerate (never dependencies of nanoqwen) besides nanoqwen-format[gguf]
and tokenizers; ~10 GB of RAM for the 1.5B. Exit status 1 if a tensor differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TEXT = REPO / "tests" / "data" / "real_model_text.py"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("text", type=Path, nargs="?", default=DEFAULT_TEXT)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()

    import torch
    from nanoqwen_format.gguf_import import GGUFTensors, read_gguf
    from nanoqwen_format.synthetic import shipped_tokenizer
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(args.gguf.parent), gguf_file=args.gguf.name,
                                                 dtype=torch.float32)
    model.eval()
    print(f"transformers loaded the GGUF in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    meta, infos = read_gguf(args.gguf)
    ours = GGUFTensors(args.gguf, infos, args.gguf.stat().st_size)
    theirs = model.state_dict()
    differ = []
    try:
        for name, e in ours.tensors.items():
            a = ours.read_rows(name, 0, e["shape"][0])
            b = theirs[name].numpy() if name in theirs else None
            if b is None or a.shape != b.shape or not np.array_equal(a, b):
                differ.append(name)
    finally:
        ours.close()
    only_theirs = sorted(set(theirs) - set(ours.tensors))
    ids = Tokenizer.from_str(shipped_tokenizer()[0]).encode(args.text.read_text()).ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="none")
    result = {"gguf": str(args.gguf), "tensors": len(ours.tensors), "differ": differ,
              "only_in_transformers": only_theirs, "text": str(args.text), "tokens": len(ids),
              "perplexity_fp32": float(torch.exp(nll.mean()))}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 1 if differ or only_theirs else 0


if __name__ == "__main__":
    sys.exit(main())
