"""Hugging Face Qwen2ForCausalLM (local folder or hub id; bf16/fp16/fp32; sharded or not; tied or not)
-> one .nanoqwen file, streamed row-chunk by row-chunk so a 7B (15 GB) checkpoint needs < 3 GB of RSS.

INT4 projections are quantized with quantize.py and packed with valueshuffle.py; everything else becomes
float16. The output appears atomically (writer.py), and the quantization error per tensor kind is
returned and, with progress=True, printed.
"""

import datetime
import json
import re
import sys
from pathlib import Path

import numpy as np

from .errors import NanoqwenFormatError
from .layout import PROJECTION_KINDS, expected_tensors, source_tensors, validate_config
from .quantize import DEFAULT_METHOD, METHODS, dequantize_int4, quantize_int4
from .safetensors_io import SafetensorsFile
from .valueshuffle import pack_valueshuffle
from .writer import NanoqwenWriter

NEEDED = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "*.safetensors", "model.safetensors.index.json"]
CHUNK_BYTES = 32 << 20  # float32 bytes per row chunk: bounds the working set (~6x this) on any shape
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")  # recomputed from rope_theta; old exports carry it


def resolve_source(src) -> tuple[Path, dict]:
    """A local folder as is; a hub id through huggingface_hub (only NEEDED files; HF cache, HF_HUB_OFFLINE)."""
    path = Path(src)
    if path.is_dir():
        return path, {"source": str(path.resolve())}
    if path.exists():
        raise NanoqwenFormatError(f"{src} is a file; give a Hugging Face model folder or hub id")
    if not HUB_ID.match(str(src)):
        raise NanoqwenFormatError(f"{src}: no such folder, and not a Hugging Face hub id (owner/name)")
    try:
        from huggingface_hub import snapshot_download
        folder = snapshot_download(repo_id=str(src), allow_patterns=NEEDED)
    except Exception as e:  # the hub raises many types (offline, 404, gated, network): report any in one line
        raise NanoqwenFormatError(f"cannot fetch {src} from the Hugging Face hub: "
                                  f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}") from None
    return Path(folder), {"source": f"hf://{src}", "snapshot": Path(folder).name}


def _read_json(path: Path, required: bool = True):
    if not path.exists():
        if required:
            raise NanoqwenFormatError(f"{path.parent.name}: {path.name} is missing")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise NanoqwenFormatError(f"{path}: not valid JSON ({e})") from None


def model_config(hf_config: dict) -> dict:
    """The HF config as a .nanoqwen file stores it, after refusing what v1 cannot represent."""
    archs = hf_config.get("architectures") or []
    if "Qwen2ForCausalLM" not in archs and not (not archs and hf_config.get("model_type") == "qwen2"):
        raise NanoqwenFormatError(f"not a Qwen2ForCausalLM checkpoint (architectures={archs}, "
                                  f"model_type={hf_config.get('model_type')!r})")
    if hf_config.get("hidden_act", "silu") != "silu":
        raise NanoqwenFormatError(f"hidden_act {hf_config['hidden_act']!r} is not supported (only silu)")
    if hf_config.get("use_sliding_window"):
        raise NanoqwenFormatError("use_sliding_window=true is not supported (nanoqwen attends to the whole context)")
    if hf_config.get("rope_scaling"):
        raise NanoqwenFormatError(f"rope_scaling {hf_config['rope_scaling']} is not supported (plain RoPE only)")
    config = dict(hf_config)
    config.setdefault("tie_word_embeddings", False)  # the Qwen2 default when the key is absent
    return validate_config(config)


def open_checkpoint(folder: Path) -> dict[str, SafetensorsFile]:
    """tensor name -> the safetensors file holding it (index.json if present, else every *.safetensors)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise NanoqwenFormatError(f"{index.name}: no weight_map")
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(p.name for p in folder.glob("*.safetensors"))
    if not names:
        raise NanoqwenFormatError(f"{folder}: no *.safetensors weights (.bin/.pt checkpoints are not supported)")
    where = {}
    for name in names:
        if not (folder / name).exists():
            raise NanoqwenFormatError(f"{folder}: shard {name} named in the index is missing")
        f = SafetensorsFile(folder / name)
        for t in f.tensors:
            where[t] = f
    return where


class _ErrorStats:
    """max and mean |w - dequant(quant(w))| per projection kind."""

    def __init__(self):
        self.max, self.sum, self.abs, self.n = {}, {}, {}, {}

    def add(self, kind, w, u, scales):
        err = np.abs(w - dequantize_int4(u, scales))
        self.max[kind] = max(self.max.get(kind, 0.0), float(err.max()))
        self.sum[kind] = self.sum.get(kind, 0.0) + float(err.sum(dtype=np.float64))
        self.abs[kind] = self.abs.get(kind, 0.0) + float(np.abs(w).sum(dtype=np.float64))
        self.n[kind] = self.n.get(kind, 0) + w.size

    def summary(self) -> dict:
        return {k: {"max_abs": self.max[k], "mean_abs": self.sum[k] / self.n[k],
                    "mean_abs_weight": self.abs[k] / self.n[k]} for k in PROJECTION_KINDS if k in self.n}


def convert(src, dst, progress: bool = True, quantizer: str = DEFAULT_METHOD,
            importance: dict | None = None) -> dict:
    """Convert; returns {"path", "bytes", "quantization_error": {kind: {max_abs, mean_abs, ...}}}.

    quantizer: the INT4 encoder (quantize.METHODS); every one writes the same format.
    importance: optional {HF projection weight name: float [K]}, per-input-column weights for the search
    encoders' error (quantize_int4); projections not named use the plain squared error.
    """
    if quantizer not in METHODS:
        raise NanoqwenFormatError(f"unknown quantizer {quantizer!r} (one of {', '.join(METHODS)})")
    folder, prov = resolve_source(src)
    prov = {**prov, "quantizer": quantizer + ("+importance" if importance else "")}
    hf_config = _read_json(folder / "config.json")
    config = model_config(hf_config)
    tok_path = folder / "tokenizer.json"
    if not tok_path.exists():
        raise NanoqwenFormatError(f"{folder.name}: tokenizer.json is missing (the file embeds it)")
    try:
        tokenizer_json = tok_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise NanoqwenFormatError(f"{tok_path}: cannot read ({e})") from None
    tokenizer_config = _read_json(folder / "tokenizer_config.json")
    generation_config = _read_json(folder / "generation_config.json", required=False)
    where = open_checkpoint(folder)
    try:
        return _convert(config, where, dst, progress, prov, tokenizer_json, tokenizer_config, generation_config,
                        quantizer, importance or {})
    finally:
        for f in set(where.values()):
            f.close()


def _convert(config, where, dst, progress, prov, tokenizer_json, tokenizer_config, generation_config,
             quantizer, importance) -> dict:
    sources = source_tensors(config)
    wanted = {s.hf_name for s in sources}
    for s in sources:
        if s.hf_name not in where:
            raise NanoqwenFormatError(f"checkpoint has no tensor {s.hf_name}")
        shape = where[s.hf_name].tensors[s.hf_name]["shape"]
        if shape != s.shape:
            raise NanoqwenFormatError(f"{s.hf_name} has shape {list(shape)} but config.json implies {list(s.shape)}")
    extra = [n for n in where if n not in wanted and not IGNORED.match(n)
             and not (n == "lm_head.weight" and config["tie_word_embeddings"])]
    if extra:
        raise NanoqwenFormatError(f"checkpoint has tensors a Qwen2ForCausalLM does not: {', '.join(sorted(extra)[:5])}")
    from . import __version__
    prov = {**prov, "converter": f"nanoqwen-format {__version__}",
            "created": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "source_dtypes": sorted({where[s.hf_name].tensors[s.hf_name]["dtype"] for s in sources})}
    total = sum(where[s.hf_name].tensors[s.hf_name]["shape"][0] for s in sources)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total, unit=" rows", desc="converting", file=sys.stderr, dynamic_ncols=True)
    stats = _ErrorStats()
    writer = NanoqwenWriter(dst, config, expected_tensors(config), tokenizer_json=tokenizer_json,
                            tokenizer_config=tokenizer_config, generation_config=generation_config,
                            provenance=prov)
    try:
        with writer as w:
            for s in sources:
                f = where[s.hf_name]
                rows = s.shape[0]
                step = max(1, CHUNK_BYTES // (4 * s.shape[1])) if len(s.shape) == 2 else rows  # 1-D: one chunk
                bounds = [(r, min(r + step, rows)) for r in range(0, rows, step)]
                if s.quantized:
                    scales = []
                    pre = s.hf_name.removesuffix(".weight")
                    w.write_tensor(f"{pre}.qweight", _quantized(f, s, bounds, scales, stats, bar, quantizer,
                                                                importance.get(s.hf_name)))
                    w.write_tensor(f"{pre}.scales", scales)
                else:
                    w.write_tensor(s.hf_name, _float16(f, s, bounds, bar))
            prov["quantization_error"] = stats.summary()  # lands in the header, written on exit
    finally:
        if bar is not None:
            bar.close()
    summary = {"path": str(dst), "bytes": writer.size, "quantization_error": stats.summary()}
    if progress:
        print(format_errors(summary["quantization_error"]), file=sys.stderr)
    return summary


def _quantized(f, s, bounds, scales_out, stats, bar, quantizer, importance):
    for r0, r1 in bounds:
        w = f.read_rows(s.hf_name, r0, r1)  # float32 [rows, K]
        u, scales = quantize_int4(w, quantizer, importance)
        stats.add(s.kind, w, u, scales)
        scales_out.append(scales)
        yield pack_valueshuffle(u)
        if bar is not None:
            bar.update(r1 - r0)


def _float16(f, s, bounds, bar):
    for r0, r1 in bounds:
        w = f.read_rows(s.hf_name, r0, r1)  # float32 [rows, ...] (a 1-D tensor: its elements)
        with np.errstate(over="ignore"):
            h = w.astype(np.float16)
        if not np.all(np.isfinite(h)):
            raise NanoqwenFormatError(f"{s.hf_name}: values outside the float16 range (or inf/NaN)")
        yield h
        if bar is not None:
            bar.update(r1 - r0)


def format_errors(errors: dict) -> str:
    lines = ["quantization error |w - w'| per projection kind:"]
    for kind, e in errors.items():
        lines.append(f"  {kind:<10} max {e['max_abs']:.3e}  mean {e['mean_abs']:.3e}  "
                     f"(mean |w| {e['mean_abs_weight']:.3e}, mean rel {e['mean_abs'] / max(e['mean_abs_weight'], 1e-30):.3f})")
    return "\n".join(lines)
