"""A GGUF file (llama.cpp, ollama) of a Qwen2 model -> one .nanoqwen file.

The file is read with ggml-org's own `gguf` package, an optional extra (`pip install
'nanoqwen-format[gguf]'`): its GGUFReader parses the header and metadata, its `gguf.quants.dequantize`
turns every tensor type it knows (F32, F16, BF16, Q4_0..Q8_0, Q2_K..Q6_K, the IQ and TQ types) into
float32. From there the tensors take the converter's own path (converter._convert): INT4 g128 for
the projections, float16 for the rest, streamed row chunk by row chunk, written atomically. A file made
from a GGUF is therefore the file the converter makes from a Hugging Face folder holding the GGUF's
dequantized weights; those weights were quantized twice (the GGUF's types, then INT4), and the file's
provenance says so, with the GGUF's tensor types.

Everything else comes from the GGUF too, so the output is as self-contained as one made from an HF folder:
the HF config from the `qwen2.*` keys, a Hugging Face tokenizer.json rebuilt from `tokenizer.ggml.*`
(byte-level BPE with Qwen2's pre-tokenizer), the chat template from `tokenizer.chat_template`.

Tensor data is read with plain file reads at the offsets the reader reports, not through the reader's
memmap: pages touched through a memmap count in the process's RSS for as long as the map lives (the whole
file by the end: 1.1 GB for the 1.5B Q4_K_M, 4.7 GB for a 7B); file reads keep the working set at the
converter's chunk bound (0.57 GB peak RSS converting the 1.5B, measured).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from .errors import NanoqwenFormatError

MAGIC = b"GGUF"
INSTALL_HINT = "reading GGUF files needs the gguf package: pip install 'nanoqwen-format[gguf]'"

# GGUF tensor names (llama.cpp's qwen2 architecture) -> Hugging Face Qwen2ForCausalLM names.
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")

# Qwen2's pre-tokenizer split, exactly as in Qwen2.5's tokenizer.json (`tokenizer.ggml.pre = "qwen2"` names
# it; llama.cpp keeps the regex in C++, not in the file).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
# llama.cpp's token types (gguf.TokenType)
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

# Sampling defaults when the GGUF has no general.sampling.* keys: Qwen2.5-Coder-Instruct's own, from the
# generation_config.json of Qwen/Qwen2.5-Coder-7B-Instruct that this package ships (data/).
SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                 "general.sampling.top_k": "top_k", "general.sampling.penalty_repeat": "repetition_penalty"}
DEFAULTS_SOURCE = "Qwen/Qwen2.5-Coder-7B-Instruct generation_config.json (shipped with nanoqwen-format)"


def is_gguf(src) -> bool:
    """True for a path ending in .gguf, or an existing file that starts with the GGUF magic."""
    path = Path(src)
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def _gguf():
    try:
        import gguf
        import gguf.quants  # noqa: F401
    except ImportError:
        raise NanoqwenFormatError(INSTALL_HINT) from None
    return gguf


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor of a qwen2 model, or None when it has none."""
    stem, dot, suffix = gguf_name.rpartition(".")
    if stem in GLOBAL_NAMES and suffix == "weight":
        return f"{GLOBAL_NAMES[stem]}.weight"
    m = BLOCK_RE.match(gguf_name)
    if m and m.group(2) in BLOCK_NAMES:
        return f"model.layers.{int(m.group(1))}.{BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


class GGUFTensors:
    """The converter's tensor-source interface over one GGUF file: `tensors` maps HF names to
    {"dtype": GGUF type name, "shape": HF shape}; read_rows(name, r0, r1) returns those rows as float32."""

    def __init__(self, path: Path, infos: list[dict], file_size: int):
        gguf = _gguf()
        self.path = path
        self.tensors: dict[str, dict] = {}
        for t in infos:
            name = hf_name(t["name"])
            if name is None:
                raise NanoqwenFormatError(f"{path.name}: tensor {t['name']} has no counterpart in a "
                                          f"Qwen2ForCausalLM")
            qtype = t["type"]
            if qtype not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) and \
                    qtype not in gguf.quants._type_traits:
                raise NanoqwenFormatError(f"{path.name}: tensor {t['name']} has type {qtype.name}, which the "
                                          f"gguf package cannot dequantize")
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            shape = tuple(reversed(t["ne"]))  # GGUF lists ne0 (the contiguous axis) first
            if shape[-1] % block:
                raise NanoqwenFormatError(f"{path.name}: tensor {t['name']} has rows of {shape[-1]} values, "
                                          f"not a multiple of {qtype.name}'s block of {block}")
            row_bytes = shape[-1] // block * type_size
            rows = math.prod(shape[:-1])
            if t["offset"] + rows * row_bytes > file_size:
                raise NanoqwenFormatError(f"{path.name}: tensor {t['name']} ends past the end of the file "
                                          f"(truncated GGUF?)")
            self.tensors[name] = {"dtype": qtype.name, "shape": shape, "qtype": qtype, "start": t["offset"],
                                  "row_bytes": row_bytes, "rows": rows, "gguf_name": t["name"]}
        self._f = open(path, "rb")

    def read_rows(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """float32 rows [start, stop) of a 2-D tensor; of a 1-D tensor, its elements [start, stop)."""
        from gguf.quants import dequantize

        e = self.tensors[name]
        one_d = len(e["shape"]) == 1
        r0, r1 = (0, e["rows"]) if one_d else (start, e["shape"][0] if stop is None else stop)
        self._f.seek(e["start"] + r0 * e["row_bytes"])
        want = (r1 - r0) * e["row_bytes"]
        raw = self._f.read(want)
        if len(raw) != want:
            raise NanoqwenFormatError(f"{self.path.name}: tensor {e['gguf_name']} is truncated")
        try:
            x = dequantize(np.frombuffer(raw, np.uint8).reshape(r1 - r0, e["row_bytes"]), e["qtype"])
        except Exception as err:  # the dequantizers assert on shapes; report any failure in one line
            raise NanoqwenFormatError(f"{self.path.name}: cannot dequantize {e['gguf_name']} "
                                      f"({e['dtype']}): {type(err).__name__}: {err}") from None
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(r1 - r0, -1)
        return x.reshape(-1)[start:stop] if one_d else x

    def close(self):
        self._f.close()


def read_gguf(path: Path) -> tuple[dict, list[dict]]:
    """(metadata {key: value}, tensor infos [{name, type, ne, offset}]) through gguf.GGUFReader.

    Any failure of the reader (bad magic, a header cut short, a tensor table past the end) is one
    NanoqwenFormatError: the reader raises ValueError, struct and numpy errors and asserts, all alike here."""
    gguf = _gguf()
    if not path.is_file():
        raise NanoqwenFormatError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != MAGIC:
        raise NanoqwenFormatError(f"{path.name}: not a GGUF file (starts with {magic!r}, want {MAGIC!r})")
    try:
        reader = gguf.GGUFReader(path, "r")
        meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        infos = [{"name": t.name, "type": gguf.GGMLQuantizationType(t.tensor_type),
                  "ne": [int(n) for n in t.shape], "offset": int(t.data_offset)} for t in reader.tensors]
    except Exception as e:
        msg = " ".join(str(e).split())[:200]
        raise NanoqwenFormatError(f"{path.name}: not a readable GGUF file, or truncated "
                                  f"({type(e).__name__}: {msg})") from None
    del reader  # drops its memmap
    return meta, infos


def _get(meta: dict, key: str, kind: type, path: Path, default=None):
    v = meta.get(key, default)
    if v is None:
        raise NanoqwenFormatError(f"{path.name}: GGUF metadata has no {key}")
    ok = isinstance(v, kind) and not (kind is int and isinstance(v, bool))
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v, ok = float(v), True
    if not ok:
        raise NanoqwenFormatError(f"{path.name}: GGUF metadata {key} is {v!r}, want a {kind.__name__}")
    return v


def hf_config(meta: dict, tensors: dict, n_tokens: int, path: Path) -> dict:
    """The Hugging Face config.json of the GGUF's model (before converter.model_config's checks)."""
    arch = meta.get("general.architecture")
    if arch != "qwen2":
        raise NanoqwenFormatError(f"{path.name}: GGUF architecture {arch!r} is not supported "
                                  f"(only qwen2: Qwen2 and Qwen2.5 models)")

    def key(k, kind=int, default=None):
        return _get(meta, f"qwen2.{k}", kind, path, default)

    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = hidden // heads if heads else 0
    for k in ("attention.key_length", "attention.value_length"):
        if f"qwen2.{k}" in meta and key(k) != head_dim:
            raise NanoqwenFormatError(f"{path.name}: qwen2.{k} = {key(k)} differs from embedding_length / "
                                      f"head_count = {head_dim} (Qwen2 has no separate head_dim)")
    scaling = meta.get("qwen2.rope.scaling.type")
    if scaling not in (None, "none"):
        raise NanoqwenFormatError(f"{path.name}: RoPE scaling {scaling!r} is not supported (plain RoPE only)")
    embed = tensors.get("model.embed_tokens.weight")
    if embed is None:
        raise NanoqwenFormatError(f"{path.name}: no token_embd.weight tensor")
    vocab = embed["shape"][0]
    if n_tokens < 0:
        raise NanoqwenFormatError(f"{path.name}: GGUF metadata has no tokenizer.ggml.tokens list")
    if n_tokens != vocab:
        raise NanoqwenFormatError(f"{path.name}: the token list has {n_tokens} entries but token_embd.weight "
                                  f"has {vocab} rows")
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", default=heads),
        "max_position_embeddings": key("context_length"),
        "rope_theta": key("rope.freq_base", float),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", float),
        "vocab_size": vocab,
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "use_sliding_window": False,
        "rope_scaling": None,
    }


def tokenizer_json(meta: dict, path: Path) -> str:
    """A Hugging Face tokenizer.json rebuilt from tokenizer.ggml.*: byte-level BPE with Qwen2's pre-tokenizer.

    NORMAL tokens form the BPE vocabulary, CONTROL and USER_DEFINED tokens become added tokens (special for
    CONTROL), UNUSED ones (llama.cpp's [PADn] fill up to the embedding's rows) are left out, as in the HF
    file. GGUF keeps one bit where HF keeps `special`: llama.cpp marks every `<|...|>` token CONTROL, so
    `<|fim_prefix|>` and its kin, not special in Qwen's file, are special here. Encoding does not depend on
    it (added tokens are matched in text either way); decode(skip_special_tokens=True) drops them."""
    model = meta.get("tokenizer.ggml.model")
    pre = meta.get("tokenizer.ggml.pre")
    if model != "gpt2" or pre != "qwen2":
        raise NanoqwenFormatError(f"{path.name}: tokenizer {model!r} with pre-tokenizer {pre!r} is not "
                                  f"supported (only Qwen2's byte-level BPE: gpt2 / qwen2)")
    tokens, types, merges = (meta.get(f"tokenizer.ggml.{k}") for k in ("tokens", "token_type", "merges"))
    if not isinstance(tokens, list) or not isinstance(types, list) or not isinstance(merges, list) \
            or len(types) != len(tokens):
        raise NanoqwenFormatError(f"{path.name}: tokenizer.ggml.tokens / token_type / merges missing or "
                                  f"inconsistent")
    vocab, added = {}, []
    for i, (tok, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind == NORMAL:
            vocab[tok] = i
        elif kind in (CONTROL, USER_DEFINED):
            added.append({"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": kind == CONTROL})
        elif kind != UNUSED:
            raise NanoqwenFormatError(f"{path.name}: token {i} ({tok!r}) has type {kind}, which a byte-level "
                                      f"BPE vocabulary does not use")
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ") if isinstance(m, str) else ("", "", "")
        if not sep or not a or not b or " " in b:
            raise NanoqwenFormatError(f"{path.name}: merge {m!r} is not two tokens separated by one space")
        pairs.append([a, b])
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
            BYTE_LEVEL]},
        "post_processor": BYTE_LEVEL, "decoder": BYTE_LEVEL,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": pairs},
    }, ensure_ascii=False)


def tokenizer_config(meta: dict, config: dict) -> dict:
    tokens = meta["tokenizer.ggml.tokens"]

    def text(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    out = {"tokenizer_class": "Qwen2Tokenizer", "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token")),
           "add_prefix_space": False, "bos_token": text("bos"), "eos_token": text("eos"),
           "pad_token": text("padding"), "unk_token": None, "errors": "replace", "split_special_tokens": False,
           "clean_up_tokenization_spaces": False, "model_max_length": config["max_position_embeddings"]}
    if isinstance(meta.get("tokenizer.chat_template"), str):
        out["chat_template"] = meta["tokenizer.chat_template"]
    return out


def generation_config(meta: dict) -> tuple[dict, str]:
    """(generation_config, where its sampling values come from). Token ids are the GGUF's. Qwen2.5 stops at
    <|im_end|> (the GGUF's eos) and <|endoftext|>, but a GGUF names one eos (and maybe an eot): the id of
    <|endoftext|> is added to the stop ids by its text, as Qwen's own generation_config lists both."""
    from .synthetic import DATA

    out = {k: v for k, v in json.loads((DATA / "generation_config.json").read_text()).items()
           if k in ("do_sample", *SAMPLING_KEYS.values())}
    source = DEFAULTS_SOURCE
    present = {v: meta[k] for k, v in SAMPLING_KEYS.items() if isinstance(meta.get(k), int | float)}
    if present:
        out.update(present)
        source = f"GGUF general.sampling.* ({', '.join(sorted(present))}), the rest from {DEFAULTS_SOURCE}"
    tokens = meta["tokenizer.ggml.tokens"]
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if isinstance(meta.get(k), int)]
    if "<|endoftext|>" in tokens:
        eos.append(tokens.index("<|endoftext|>"))
    out["eos_token_id"] = list(dict.fromkeys(eos))
    for key in ("bos", "padding"):
        if isinstance(meta.get(f"tokenizer.ggml.{key}_token_id"), int):
            out[f"{'pad' if key == 'padding' else key}_token_id"] = meta[f"tokenizer.ggml.{key}_token_id"]
    return out, source


def convert_gguf(src, dst, progress: bool = True, quantizer: str | None = None) -> dict:
    """Convert a qwen2 GGUF file; returns what converter.convert returns. quantizer: the INT4 encoder
    (quantize.METHODS; default the converter's)."""
    from .converter import _convert, check_destination, check_not_an_input, model_config
    from .quantize import DEFAULT_METHOD

    path = Path(src)
    check_not_an_input(Path(dst), [path])
    check_destination(Path(dst))
    if progress:
        import sys
        print(f"reading {path.name} (GGUF header and vocabulary)...", file=sys.stderr)
    meta, infos = read_gguf(path)
    source = GGUFTensors(path, infos, path.stat().st_size)
    try:
        tokens = meta.get("tokenizer.ggml.tokens")
        n_tokens = len(tokens) if isinstance(tokens, list) else -1
        config = model_config(hf_config(meta, source.tensors, n_tokens, path))
        tok_json = tokenizer_json(meta, path)
        gen, gen_source = generation_config(meta)
        counts: dict[str, int] = {}
        for e in source.tensors.values():
            counts[e["dtype"]] = counts.get(e["dtype"], 0) + 1
        prov = {"source": str(path.resolve()), "source_format": "gguf",
                "gguf": {"name": meta.get("general.name"), "file_bytes": path.stat().st_size,
                         "tensor_types": dict(sorted(counts.items()))},
                "generation_config_source": gen_source}
        where = dict.fromkeys(source.tensors, source)
        prov["quantizer"] = quantizer or DEFAULT_METHOD
        return _convert(config, where, dst, progress, prov, tok_json, tokenizer_config(meta, config), gen,
                        quantizer or DEFAULT_METHOD, {})
    finally:
        source.close()
