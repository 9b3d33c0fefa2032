"""What a .nanoqwen v1 file holds: the constants of the fixed header, the model config's rules, and the one
ordered tensor list that the writer, the reader, the converter and the synthetic generator all share."""

import math
from dataclasses import dataclass

from .errors import NanoqwenFormatError
from .quantize import GROUP

MAGIC = b"NANOQWEN"  # bytes 0..7 (0x4E414E4F5157454E read big-endian)
VERSION = 1
FIXED_HEADER = 24  # magic 8 + version u32 + flags u32 + JSON length u64
ALIGN = 4096  # the data section and every tensor start on a 4096-byte boundary (mmap pages, zero-copy views)
MAX_JSON = 1 << 30  # a header larger than this is refused rather than read (the real one is ~7 MB)

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

# Config keys every file carries, with their type (bool is checked apart: it is an int in Python).
INT_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size")
FLOAT_KEYS = ("rms_norm_eps", "rope_theta")
LIMITS = {"hidden_size": 1 << 16, "intermediate_size": 1 << 18, "num_hidden_layers": 1024,
          "num_attention_heads": 1024, "num_key_value_heads": 1024, "vocab_size": 1 << 22}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # "uint32" (ValueShuffle words) or "float16"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def head_dim(config: dict) -> int:
    return config["hidden_size"] // config["num_attention_heads"]


def validate_config(config) -> dict:
    """Check the model config a file (or a converter) relies on; returns it unchanged."""
    if not isinstance(config, dict):
        raise NanoqwenFormatError("config must be a JSON object")
    for key in INT_KEYS:
        v = config.get(key)
        if not _is_int(v) or not 0 < v <= LIMITS[key]:
            raise NanoqwenFormatError(f"config: {key} must be an integer in 1..{LIMITS[key]}, got {v!r}")
    for key in FLOAT_KEYS:
        v = config.get(key)
        if not (_is_int(v) or isinstance(v, float)) or not (0 < v < math.inf):
            raise NanoqwenFormatError(f"config: {key} must be a positive finite number, got {v!r}")
    if not isinstance(config.get("tie_word_embeddings"), bool):
        raise NanoqwenFormatError("config: tie_word_embeddings must be true or false")
    h, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    if h % heads:
        raise NanoqwenFormatError(f"config: hidden_size {h} is not a multiple of num_attention_heads {heads}")
    if heads % kv:
        raise NanoqwenFormatError(f"config: num_attention_heads {heads} is not a multiple of "
                                  f"num_key_value_heads {kv}")
    if "head_dim" in config and config["head_dim"] != h // heads:
        raise NanoqwenFormatError(f"config: head_dim {config['head_dim']!r} != hidden_size/num_attention_heads "
                                  f"= {h // heads} (Qwen2 has no separate head_dim)")
    for key in ("hidden_size", "intermediate_size"):
        if config[key] % GROUP:
            raise NanoqwenFormatError(f"config: {key} {config[key]} is not a multiple of the "
                                      f"quantization group {GROUP}")
    return config


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
