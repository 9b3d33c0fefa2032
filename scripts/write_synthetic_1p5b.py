"""Write a synthetic model of the real Qwen2.5-Coder-1.5B's dims (random INT4 weights): for speed runs on a
GPU machine that does not hold the real model (the real one's figures come from its converted GGUF).

    python scripts/write_synthetic_1p5b.py OUT.nanoqwen [--seed 0]
"""

from __future__ import annotations

import argparse

from nanoqwen_format.synthetic import qwen7b_config, write_synthetic

QWEN25_CODER_1P5B = dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
                         vocab_size=151936, tie_word_embeddings=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    config = {**qwen7b_config(), **QWEN25_CODER_1P5B}
    print(write_synthetic(args.out, config, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
