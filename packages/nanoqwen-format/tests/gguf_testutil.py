"""Small GGUF files for the import tests, written with ggml-org's own gguf.GGUFWriter as llama.cpp's
converter lays out a qwen2 model (its tensor names, its token types, [PADn] fill), and their expected
contents: every tensor dequantized by gguf.quants.dequantize, keyed by the Hugging Face name."""

import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

CORPUS = Path(__file__).parent / "data" / "tokenizer_corpus.json"
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

# Types gguf.quants can quantize: the tests quantize random weights with it.
QUANTIZABLE = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
# Types it can only dequantize (the K-quants): random blocks with their fp16 fields set to sane scales.
# type -> byte offsets of the block's fp16 fields (super-block scale d, and dmin where there is one)
KNOWN_BYTES = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
TYPES = QUANTIZABLE + tuple(KNOWN_BYTES)


def tensor_names(config: dict, tied: bool) -> list[tuple[str, str, tuple[int, ...]]]:
    """(GGUF name, HF name, HF shape) of every tensor of a qwen2 model, in llama.cpp's order."""
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    out = [("token_embd.weight", "model.embed_tokens.weight", (v, h))]
    for i in range(config["num_hidden_layers"]):
        p, b = f"blk.{i}", f"model.layers.{i}"
        out += [
            (f"{p}.attn_norm.weight", f"{b}.input_layernorm.weight", (h,)),
            (f"{p}.attn_q.weight", f"{b}.self_attn.q_proj.weight", (q, h)),
            (f"{p}.attn_q.bias", f"{b}.self_attn.q_proj.bias", (q,)),
            (f"{p}.attn_k.weight", f"{b}.self_attn.k_proj.weight", (kv, h)),
            (f"{p}.attn_k.bias", f"{b}.self_attn.k_proj.bias", (kv,)),
            (f"{p}.attn_v.weight", f"{b}.self_attn.v_proj.weight", (kv, h)),
            (f"{p}.attn_v.bias", f"{b}.self_attn.v_proj.bias", (kv,)),
            (f"{p}.attn_output.weight", f"{b}.self_attn.o_proj.weight", (h, q)),
            (f"{p}.ffn_norm.weight", f"{b}.post_attention_layernorm.weight", (h,)),
            (f"{p}.ffn_gate.weight", f"{b}.mlp.gate_proj.weight", (inter, h)),
            (f"{p}.ffn_up.weight", f"{b}.mlp.up_proj.weight", (inter, h)),
            (f"{p}.ffn_down.weight", f"{b}.mlp.down_proj.weight", (h, inter)),
        ]
    out.append(("output_norm.weight", "model.norm.weight", (h,)))
    if not tied:
        out.append(("output.weight", "lm_head.weight", (v, h)))
    return out


def encode_tensor(rng, shape, qtype) -> np.ndarray:
    """What GGUFWriter.add_tensor takes for random values of `shape` stored as `qtype`."""
    if qtype in KNOWN_BYTES:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        n_blocks = int(np.prod(shape)) // block
        raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
        for off in KNOWN_BYTES[qtype]:
            scale = (rng.uniform(2e-4, 2e-3, n_blocks) * rng.choice([-1, 1], n_blocks)).astype("<f2")
            raw[:, off:off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
        return raw.reshape(*shape[:-1], shape[-1] // block * size)
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    return w if qtype == T.F32 else quantize(w, qtype)


def small_vocab(n: int, tokenizer_json: str) -> tuple[list[str], list[int], list[str]]:
    """A consistent n-token byte-level BPE vocabulary: Qwen's first n-3 tokens, the merges among them, and
    three control tokens at the end."""
    spec = json.loads(tokenizer_json)
    by_id = {i: t for t, i in spec["model"]["vocab"].items()}
    tokens = [by_id[i] for i in range(n - 3)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    known = set(tokens)
    merges = [f"{a} {b}" for a, b in (_pair(m) for m in spec["model"]["merges"])
              if a in known and b in known and a + b in known]
    return tokens, [NORMAL] * (n - 3) + [CONTROL] * 3, merges


def _pair(m) -> tuple[str, str]:
    return tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1))


def vocab_from_tokenizer_json(tokenizer_json: str, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) as llama.cpp's converter writes them from an HF tokenizer.json: added
    tokens CONTROL when special or when they look special (`<|...|>`), else USER_DEFINED; ids the tokenizer
    does not use up to the embedding's rows become UNUSED "[PADn]"."""
    spec = json.loads(tokenizer_json)
    by_id = {i: t for t, i in spec["model"]["vocab"].items()}
    added = {a["id"]: a for a in spec["added_tokens"]}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in added:
            text = added[i]["content"]
            looks_special = text.startswith("<|") and text.endswith("|>")
            tokens.append(text)
            types.append(CONTROL if added[i]["special"] or looks_special else USER_DEFINED)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
    return tokens, types, [" ".join(_pair(m)) for m in spec["model"]["merges"]]


def add_tokenizer(w: gguf.GGUFWriter, tokens, types, merges, *, eos=None, bos=None, pad=None,
                  template: str | None = None, model: str = "gpt2", pre: str = "qwen2") -> None:
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for value, add in ((eos, w.add_eos_token_id), (bos, w.add_bos_token_id), (pad, w.add_pad_token_id)):
        if value is not None:
            add(value)
    w.add_add_bos_token(False)
    if template is not None:
        w.add_chat_template(template)


def write_gguf(path, config: dict, qtype, rng, *, tied: bool = False, vocab=None, arch: str = "qwen2",
               template: str | None = "{{ messages }}", extra=None, skip_keys=()) -> dict[str, np.ndarray]:
    """A qwen2 GGUF of `config`; returns {HF name: float32 values the file holds}.

    qtype: one type for every 2-D tensor, or a function (HF name -> type). Norms and biases are F32, as
    llama.cpp writes them. vocab: (tokens, types, merges) with config["vocab_size"] tokens, or None for
    no tokenizer fields. extra: a function (writer) -> None that adds more (e.g. a stray tensor or key).
    skip_keys: metadata keys (qwen2.* suffixes) to leave out."""
    pick = qtype if callable(qtype) else (lambda name: qtype)
    w = gguf.GGUFWriter(str(path), arch)
    values = {
        "context_length": (w.add_context_length, config.get("max_position_embeddings", 32768)),
        "embedding_length": (w.add_embedding_length, config["hidden_size"]),
        "feed_forward_length": (w.add_feed_forward_length, config["intermediate_size"]),
        "block_count": (w.add_block_count, config["num_hidden_layers"]),
        "attention.head_count": (w.add_head_count, config["num_attention_heads"]),
        "attention.head_count_kv": (w.add_head_count_kv, config["num_key_value_heads"]),
        "rope.freq_base": (w.add_rope_freq_base, config["rope_theta"]),
        "attention.layer_norm_rms_epsilon": (w.add_layer_norm_rms_eps, config["rms_norm_eps"]),
    }
    for key, (add, value) in values.items():
        if key not in skip_keys:
            add(value)
    w.add_name("test model")
    if vocab is not None:
        tokens, types, merges = vocab
        eos = tokens.index("<|im_end|>") if "<|im_end|>" in tokens else None
        end = tokens.index("<|endoftext|>") if "<|endoftext|>" in tokens else None
        add_tokenizer(w, tokens, types, merges, eos=eos, bos=end, pad=end, template=template)
    expected = {}
    for gname, hname, shape in tensor_names(config, tied):
        t = T.F32 if len(shape) == 1 else pick(hname)
        data = encode_tensor(rng, shape, t)
        w.add_tensor(gname, data, raw_dtype=None if t in (T.F32, T.F16) else t)
        expected[hname] = dequantize(data, t).astype(np.float32).reshape(shape)
    if extra is not None:
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected
