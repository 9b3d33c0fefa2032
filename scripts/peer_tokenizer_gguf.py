"""Write a tensor-less GGUF holding only the tokenizer.* fields of a real Qwen2.5 GGUF (~6 MB), so the
7B-shaped GGUF for llama.cpp (scripts/write_gguf_7b.py --tokenizer-from) can be made on the GPU machine
without moving the 1.1 GB real model there first.

    python3 scripts/peer_tokenizer_gguf.py real-1.5b.gguf .peer/qwen2.5-tokenizer.gguf

Needs the `gguf` package (nanoqwen-format[gguf]).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("real", help="a real Qwen2.5 GGUF (e.g. the Qwen2.5-Coder-1.5B-Instruct Q4_K_M)")
    ap.add_argument("out")
    a = ap.parse_args()
    import gguf

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from write_gguf_7b import add_field, tokenizer_fields

    fields = tokenizer_fields(gguf.GGUFReader(a.real))
    if not any(k == "tokenizer.ggml.tokens" for k, _, _ in fields):
        raise SystemExit(f"{a.real}: no tokenizer.ggml.tokens field: not a GGUF with a tokenizer")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(a.out, "qwen2")
    for key, value, types in fields:
        add_field(w, gguf, key, value, types)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{a.out}: {len(fields)} tokenizer fields, {Path(a.out).stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
