"""What a .nanoqwen v1 file holds: the constants of the fixed header, the model config's rules, and the one
ordered tensor list that the writer, the reader, the converter and the synthetic generator all share."""

import math
from dataclasses import dataclass

from .errors import NanoqwenFormatError
from .quantize import GROUP
from .strict import int_in, is_finite_number, is_int, short

MAGIC = b"NANOQWEN"  # bytes 0..7 (0x4E414E4F5157454E read big-endian)
VERSION = 1
FIXED_HEADER = 24  # magic 8 + version u32 + flags u32 + JSON length u64
ALIGN = 4096  # the data section and every tensor start on a 4096-byte boundary (mmap pages, zero-copy views)
# The JSON header's length N is at most MAX_JSON, checked before any byte of it is read. What a real header
# needs: the tokenizer.json text as one JSON string (Qwen2's: 5.4 MB, 6.3 MB escaped), the tensor table
# (3 + 19 L entries of <= ~190 bytes: 0.1 MB at 28 layers, 3.6 MB at the 1024 layers section 3 allows),
# the config, tokenizer_config, generation_config and provenance (a few KB) and the writer's slack (16 KiB
# + 24 bytes per entry). 16 MiB holds all that with a tokenizer up to ~2x Qwen2's, and bounds what a
# reader allocates for a hostile header (parsed, 16 MiB of JSON is at most a few hundred MB of objects).
MAX_JSON = 16 << 20

QUANTIZATION = {  # the only quantization v1 knows; the reader demands exactly this block
    "bits": 4,
    "group_size": GROUP,
    "symmetric": True,
    "zero_point": 8,
    "scale_dtype": "float16",
    "packing": "valueshuffle-v1",
}
DTYPES = {"uint32": 4, "float16": 2}  # dtype name -> itemsize; both little-endian
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PROJECTION_KINDS = ATTN + MLP

# Config keys every file carries, with their bounds (FORMAT.md section 3).
INT_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size")
FLOAT_KEYS = ("rms_norm_eps", "rope_theta")
LIMITS = {"hidden_size": 1 << 16, "intermediate_size": 1 << 18, "num_hidden_layers": 1024,
          "num_attention_heads": 1024, "num_key_value_heads": 1024, "vocab_size": 1 << 22}
MAX_POSITIONS = 1 << 24  # max_position_embeddings: Qwen2 models train for 32768..131072
MAX_TOKEN_ID = (1 << 31) - 1


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # "uint32" (ValueShuffle words) or "float16"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype]


def head_dim(config: dict) -> int:
    return config["hidden_size"] // config["num_attention_heads"]


def _bad(section: str, key: str, want: str, value) -> NanoqwenFormatError:
    return NanoqwenFormatError(f"{section}: {key} must be {want}, got {short(value)}")


def _check_token_ids(section: str, d: dict) -> None:
    """eos_token_id: absent, null, a token id, or a list of token ids (the engine stops on any)."""
    v = d.get("eos_token_id")
    ids = v if isinstance(v, list) else [v] if v is not None else []
    if not all(int_in(i, 0, MAX_TOKEN_ID) for i in ids):
        raise _bad(section, "eos_token_id", f"a token id in 0..{MAX_TOKEN_ID} or a list of them", v)


def validate_config(config) -> dict:
    """Check the model config a file (or a converter) relies on; returns it unchanged.

    Beyond the dims: every value the engine reads (eos ids, max_position_embeddings) has its type, and the
    keys that would make the model something other than plain Qwen2 are refused, so that a file which
    opens never makes the engine compute a different model or fail on a value."""
    if not isinstance(config, dict):
        raise NanoqwenFormatError("config must be a JSON object")
    for key in INT_KEYS:
        v = config.get(key)
        if not int_in(v, 1, LIMITS[key]):
            raise _bad("config", key, f"an integer in 1..{LIMITS[key]}", v)
    for key in FLOAT_KEYS:
        v = config.get(key)
        if not is_finite_number(v) or not v > 0:
            raise _bad("config", key, "a positive finite number", v)
    if not isinstance(config.get("tie_word_embeddings"), bool):
        raise _bad("config", "tie_word_embeddings", "true or false", config.get("tie_word_embeddings"))
    h, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    if h % heads:
        raise NanoqwenFormatError(f"config: hidden_size {h} is not a multiple of num_attention_heads {heads}")
    if heads % kv:
        raise NanoqwenFormatError(f"config: num_attention_heads {heads} is not a multiple of "
                                  f"num_key_value_heads {kv}")
    if "head_dim" in config and not (is_int(config["head_dim"]) and config["head_dim"] == h // heads):
        raise NanoqwenFormatError(f"config: head_dim {short(config['head_dim'])} != hidden_size/num_attention_heads "
                                  f"= {h // heads} (Qwen2 has no separate head_dim)")
    for key in ("hidden_size", "intermediate_size"):
        if config[key] % GROUP:
            raise NanoqwenFormatError(f"config: {key} {config[key]} is not a multiple of the "
                                      f"quantization group {GROUP}")
    if "max_position_embeddings" in config and not int_in(config["max_position_embeddings"], 1, MAX_POSITIONS):
        raise _bad("config", "max_position_embeddings", f"an integer in 1..{MAX_POSITIONS}",
                   config["max_position_embeddings"])
    _check_token_ids("config", config)
    # Plain Qwen2 only: these would change the computation, and nanoqwen implements none of them.
    if config.get("model_type", "qwen2") != "qwen2":
        raise _bad("config", "model_type", '"qwen2"', config["model_type"])
    if config.get("hidden_act", "silu") != "silu":
        raise _bad("config", "hidden_act", '"silu" (the only activation nanoqwen implements)', config["hidden_act"])
    if config.get("use_sliding_window", False) is not False:
        raise _bad("config", "use_sliding_window", "false (nanoqwen attends to the whole context)",
                   config["use_sliding_window"])
    if config.get("rope_scaling") not in (None, {}):
        raise _bad("config", "rope_scaling", "null (plain RoPE only)", config["rope_scaling"])
    return config


def validate_tokenizer_config(tokenizer_config) -> dict:
    """tokenizer_config: an object whose chat_template, if set, is a Jinja string or the newer list of
    {"name", "template"} strings."""
    if not isinstance(tokenizer_config, dict):
        raise NanoqwenFormatError(f"tokenizer_config must be a JSON object, got {short(tokenizer_config)}")
    t = tokenizer_config.get("chat_template")
    named = isinstance(t, list) and t and all(
        isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("template"), str) for e in t)
    if not (t is None or isinstance(t, str) or named):
        raise _bad("tokenizer_config", "chat_template",
                   'a string or a non-empty list of {"name": string, "template": string}', t)
    return tokenizer_config


# generation_config keys the engine reads, each with its rule (null: "not set", where the engine allows it)
_GENERATION = {
    "temperature": ("a finite number >= 0", False, lambda v: is_finite_number(v) and v >= 0),
    "top_p": ("a number in (0, 1]", True, lambda v: is_finite_number(v) and 0 < v <= 1),
    "min_p": ("a number in [0, 1]", True, lambda v: is_finite_number(v) and 0 <= v <= 1),
    "top_k": (f"an integer in 0..{MAX_TOKEN_ID}", True, lambda v: int_in(v, 0, MAX_TOKEN_ID)),
    "repetition_penalty": ("a finite number > 0", True, lambda v: is_finite_number(v) and v > 0),
    "max_new_tokens": (f"an integer in 1..{MAX_TOKEN_ID}", True, lambda v: int_in(v, 1, MAX_TOKEN_ID)),
    "do_sample": ("true or false", False, lambda v: isinstance(v, bool)),
}


def validate_generation_config(generation_config) -> dict:
    """generation_config: an object whose sampling defaults, where present, are in range."""
    if not isinstance(generation_config, dict):
        raise NanoqwenFormatError(f"generation_config must be a JSON object, got {short(generation_config)}")
    for key, (want, nullable, ok) in _GENERATION.items():
        if key in generation_config:
            v = generation_config[key]
            if not ((v is None and nullable) or (v is not None and ok(v))):
                raise _bad("generation_config", key, want + (" or null" if nullable else ""), v)
    _check_token_ids("generation_config", generation_config)
    return generation_config


def projection_shape(config: dict, kind: str) -> tuple[int, int]:
    """[N_out, K] of an HF projection weight."""
    h, i, hd = config["hidden_size"], config["intermediate_size"], head_dim(config)
    q_out, kv_out = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    return {"q_proj": (q_out, h), "k_proj": (kv_out, h), "v_proj": (kv_out, h), "o_proj": (h, q_out),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}[kind]


def projection_prefix(layer: int, kind: str) -> str:
    block = "self_attn" if kind in ATTN else "mlp"
    return f"model.layers.{layer}.{block}.{kind}"


@dataclass(frozen=True)
class SourceTensor:
    """One HF checkpoint tensor and how it is stored: quantized (-> .qweight + .scales) or float16."""
    hf_name: str
    shape: tuple[int, ...]
    quantized: bool
    kind: str  # projection kind, or "embed", "norm", "bias", "lm_head"


def source_tensors(config: dict) -> list[SourceTensor]:
    """The HF tensors of a Qwen2ForCausalLM in file order (lm_head only when untied)."""
    h, v, hd = config["hidden_size"], config["vocab_size"], head_dim(config)
    out = [SourceTensor("model.embed_tokens.weight", (v, h), False, "embed")]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out.append(SourceTensor(f"{p}.input_layernorm.weight", (h,), False, "norm"))
        for kind in PROJECTION_KINDS:
            if kind == "gate_proj":
                out.append(SourceTensor(f"{p}.post_attention_layernorm.weight", (h,), False, "norm"))
            pre = projection_prefix(i, kind)
            out.append(SourceTensor(f"{pre}.weight", projection_shape(config, kind), True, kind))
            if kind in ("q_proj", "k_proj", "v_proj"):
                n = config["num_attention_heads" if kind == "q_proj" else "num_key_value_heads"] * hd
                out.append(SourceTensor(f"{pre}.bias", (n,), False, "bias"))
    out.append(SourceTensor("model.norm.weight", (h,), False, "norm"))
    if not config["tie_word_embeddings"]:
        out.append(SourceTensor("lm_head.weight", (v, h), False, "lm_head"))
    return out


def file_tensors(source: SourceTensor) -> list[TensorSpec]:
    """The .nanoqwen tensors one HF tensor becomes."""
    if not source.quantized:
        return [TensorSpec(source.hf_name, "float16", source.shape)]
    n, k = source.shape
    pre = source.hf_name.removesuffix(".weight")
    return [TensorSpec(f"{pre}.qweight", "uint32", (n, k // 8)),
            TensorSpec(f"{pre}.scales", "float16", (n, k // GROUP))]


def expected_tensors(config: dict) -> list[TensorSpec]:
    """Every tensor a file of this config holds, in the order the writer lays them out."""
    return [t for s in source_tensors(config) for t in file_tensors(s)]


def align_up(x: int, a: int = ALIGN) -> int:
    return (x + a - 1) // a * a
