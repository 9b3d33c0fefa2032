"""Write a 7B-shaped Qwen2 GGUF (random F16 weights) for llama.cpp's side of the peer comparison.

llama.cpp needs a GGUF of the same shape as our synthetic 7B .nanoqwen; `llama-quantize OUT Q4_K_M` then
turns this F16 file into the quantization llama.cpp users run. Random weights are fine for speed (every
kernel's cost depends on the shapes, not the values); the tokenizer fields and chat template are copied
from a real Qwen2.5-Coder GGUF (the 1.5B: same tokenizer as the 7B), so the file loads like a real one.

    python3 scripts/write_gguf_7b.py --tokenizer-from real-1.5b.gguf OUT.gguf

Shapes: the 7B config (nanoqwen_format's shipped config.json: hidden 3584, intermediate 18944, 28 layers,
28 heads, 4 KV heads, vocab 152064, untied lm_head). Values: a 64 M-element table of N(0, 0.02) fp16
drawn once and cycled, so the 15 GB file is written at disk speed instead of spending minutes in the RNG.
Needs the `gguf` package (ggml-org's; on the GPU machine it travels as a wheel).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

CONFIG = (Path(__file__).resolve().parents[1] / "packages/nanoqwen-format/src/nanoqwen_format/data/"
          "qwen2.5-coder-7b-instruct/config.json")
TABLE = 1 << 26  # fp16 values drawn once, cycled through every tensor


def tokenizer_fields(reader) -> list[tuple[str, object, object]]:
    """(key, value, GGUFValueType) of every tokenizer.* field of a GGUF reader, chat template included."""
    out = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            out.append((key, field.contents(), field.types))
    return out


def add_field(writer, gguf, key: str, value, types) -> None:
    vt = types[0]
    if vt == gguf.GGUFValueType.ARRAY:
        writer.add_array(key, value)
    elif vt == gguf.GGUFValueType.STRING:
        writer.add_string(key, value)
    elif vt == gguf.GGUFValueType.BOOL:
        writer.add_bool(key, bool(value))
    elif vt == gguf.GGUFValueType.UINT32:
        writer.add_uint32(key, int(value))
    elif vt == gguf.GGUFValueType.INT32:
        writer.add_int32(key, int(value))
    elif vt == gguf.GGUFValueType.FLOAT32:
        writer.add_float32(key, float(value))
    else:
        raise SystemExit(f"unhandled tokenizer field type {vt} for {key}")


def tensor_shapes(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF names and numpy shapes ([rows, cols] = [out, in]) of a Qwen2 model, in llama.cpp's order."""
    H, Im, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    hd = H // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    shapes = [("token_embd.weight", (V, H))]
    for i in range(L):
        b = f"blk.{i}."
        shapes += [
            (b + "attn_norm.weight", (H,)), (b + "attn_q.weight", (H, H)), (b + "attn_q.bias", (H,)),
            (b + "attn_k.weight", (kv, H)), (b + "attn_k.bias", (kv,)), (b + "attn_v.weight", (kv, H)),
            (b + "attn_v.bias", (kv,)), (b + "attn_output.weight", (H, H)), (b + "ffn_norm.weight", (H,)),
            (b + "ffn_gate.weight", (Im, H)), (b + "ffn_up.weight", (Im, H)), (b + "ffn_down.weight", (H, Im)),
        ]
    shapes += [("output_norm.weight", (H,)), ("output.weight", (V, H))]
    return shapes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--tokenizer-from", required=True, help="a real Qwen2.5 GGUF to copy tokenizer.* from")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (a quick check)")
    args = ap.parse_args()
    import gguf

    t0 = time.perf_counter()
    c = json.loads(CONFIG.read_text())
    if args.layers is not None:
        c["num_hidden_layers"] = args.layers
    src = gguf.GGUFReader(args.tokenizer_from)
    w = gguf.GGUFWriter(args.out, "qwen2")
    w.add_name("nanoqwen synthetic 7B-shaped Qwen2 (random weights)")
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(float(c["rope_theta"]))
    w.add_layer_norm_rms_eps(float(c["rms_norm_eps"]))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    fields = {k: [v, t] for k, v, t in tokenizer_fields(src)}
    # The 7B's embedding has 152064 rows, the tokenizer 151936 tokens: pad the vocabulary as llama.cpp's own
    # HF converter does for Qwen2 ("[PAD{i}]", type UNUSED), since llama.cpp takes n_vocab from the token list.
    tokens = list(fields["tokenizer.ggml.tokens"][0])
    ttypes = list(fields["tokenizer.ggml.token_type"][0])
    for i in range(len(tokens), c["vocab_size"]):
        tokens.append(f"[PAD{i}]")
        ttypes.append(int(gguf.TokenType.UNUSED))
    fields["tokenizer.ggml.tokens"][0], fields["tokenizer.ggml.token_type"][0] = tokens, ttypes
    for key, (value, types) in fields.items():
        add_field(w, gguf, key, value, types)
    table = (np.random.default_rng(0).standard_normal(TABLE, dtype=np.float32) * 0.02).astype(np.float16)
    ones = np.ones(c["hidden_size"], dtype=np.float32)
    shapes = tensor_shapes(c)
    pos = 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        if name.endswith("norm.weight"):  # norms: 1 (f32, as llama.cpp's converter writes them)
            w.add_tensor(name, ones[:n].reshape(shape))
            continue
        if name.endswith(".bias"):
            w.add_tensor(name, table[:n].astype(np.float32).reshape(shape))
            continue
        arr = table[pos:pos + n] if pos + n <= TABLE else np.resize(np.roll(table, -pos), n)
        pos = (pos + 7919) % TABLE
        w.add_tensor(name, arr.reshape(shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    size = Path(args.out).stat().st_size
    print(f"wrote {args.out}: {size / 1e9:.2f} GB, {len(shapes)} tensors in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
