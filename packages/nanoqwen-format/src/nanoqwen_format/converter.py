"""Hugging Face Qwen2ForCausalLM (local folder or hub id; bf16/fp16/fp32; sharded or not; tied or not)
-> one .nanoqwen file, streamed row-chunk by row-chunk so a 7B (15 GB) checkpoint needs < 3 GB of RSS.

INT4 projections are quantized with quantize.py and packed with valueshuffle.py; everything else becomes
float16. The output appears atomically (writer.py), and the quantization error per tensor kind is
returned and, with progress=True, printed.
"""

import datetime
import re
import sys
from pathlib import Path

import numpy as np

from .errors import NanoqwenFormatError
from .layout import (
    MAX_JSON,
    PROJECTION_KINDS,
    expected_tensors,
    source_tensors,
    validate_config,
    validate_generation_config,
    validate_tokenizer_config,
)
from .quantize import DEFAULT_METHOD, METHODS, dequantize_int4, quantize_int4
from .safetensors_io import SafetensorsFile
from .strict import loads, open_regular, short
from .valueshuffle import pack_valueshuffle
from .writer import NanoqwenWriter, check_destination, check_not_an_input

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


def _read_text(path: Path, required: bool = True) -> str | None:
    """A source file's text (UTF-8, a regular file, at most MAX_JSON bytes); None if optional and absent."""
    if not path.exists() and not path.is_symlink():
        if required:
            raise NanoqwenFormatError(f"{path.parent.name}: {path.name} is missing")
        return None
    f, size = open_regular(path, path.name)
    with f:
        if size > MAX_JSON:
            raise NanoqwenFormatError(f"{path.name}: {size} bytes, more than the {MAX_JSON >> 20} MiB a "
                                      f".nanoqwen header can embed")
        try:
            return f.read().decode("utf-8")
        except OSError as e:
            raise NanoqwenFormatError(f"{path.name}: cannot read ({e.strerror or e})") from None
        except UnicodeDecodeError as e:
            raise NanoqwenFormatError(f"{path.name} is not valid UTF-8: {e.reason} at byte {e.start}") from None


def _read_json(path: Path, required: bool = True):
    """A source JSON file, parsed as strictly as the reader parses its header; {} if optional and absent."""
    text = _read_text(path, required)
    return {} if text is None else loads(text, path.name)


def model_config(hf_config) -> dict:
    """The HF config as a .nanoqwen file stores it, after refusing what v1 cannot represent
    (layout.validate_config: the same rules the reader applies)."""
    if not isinstance(hf_config, dict):
        raise NanoqwenFormatError(f"config.json must be a JSON object, got {short(hf_config)}")
    archs = hf_config.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise NanoqwenFormatError(f"config.json: architectures must be a list of strings, got {short(archs)}")
    if "Qwen2ForCausalLM" not in archs and not (not archs and hf_config.get("model_type") == "qwen2"):
        raise NanoqwenFormatError(f"not a Qwen2ForCausalLM checkpoint (architectures={short(archs)}, "
                                  f"model_type={short(hf_config.get('model_type'))})")
    config = dict(hf_config)
    config.setdefault("tie_word_embeddings", False)  # the Qwen2 default when the key is absent
    return validate_config(config)


def _shard_names(folder: Path, index: Path) -> list[str]:
    """The shard files model.safetensors.index.json names: plain file names in `folder`."""
    index_json = _read_json(index)
    weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise NanoqwenFormatError(f"{index.name}: no weight_map object")
    names = set(weight_map.values())
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or name in (".", "..") \
                or not name.endswith(".safetensors"):
            raise NanoqwenFormatError(f"{index.name}: shard {short(name)} is not a .safetensors file name "
                                      f"in the checkpoint folder")
    return sorted(names)


def open_checkpoint(folder: Path) -> dict[str, SafetensorsFile]:
    """tensor name -> the safetensors file holding it (index.json if present, else every *.safetensors)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = _shard_names(folder, index)
    else:
        names = sorted(p.name for p in folder.glob("*.safetensors"))
    if not names:
        raise NanoqwenFormatError(f"{folder}: no *.safetensors weights (.bin/.pt checkpoints are not supported)")
    where: dict[str, SafetensorsFile] = {}
    opened = []
    try:
        for name in names:
            if not (folder / name).exists():
                raise NanoqwenFormatError(f"{folder}: shard {name} named in the index is missing")
            f = SafetensorsFile(folder / name)
            opened.append(f)
            for t in f.tensors:
                if t in where:
                    raise NanoqwenFormatError(f"tensor {short(t)} is in both {where[t].path.name} and {name}")
                where[t] = f
    except BaseException:
        for f in opened:
            f.close()
        raise
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

    src: a Hugging Face folder or hub id, or a GGUF file (gguf_import.py). Every input that ends up in
    the file is checked before any weight is read, with the reader's own rules (a finished conversion
    always opens), and dst may be neither an input nor inside the source.
    quantizer: the INT4 encoder (quantize.METHODS); every one writes the same format.
    importance: optional {HF projection weight name: float [K]}, per-input-column weights for the search
    encoders' error (quantize_int4); projections not named use the plain squared error.
    """
    if quantizer not in METHODS:
        raise NanoqwenFormatError(f"unknown quantizer {quantizer!r} (one of {', '.join(METHODS)})")
    from .gguf_import import convert_gguf, is_gguf
    if is_gguf(src):
        return convert_gguf(src, dst, progress, quantizer=quantizer)
    folder, prov = resolve_source(src)
    prov = {**prov, "quantizer": quantizer + ("+importance" if importance else "")}
    dst = Path(dst)
    try:
        inputs = list(folder.iterdir())
    except OSError as e:
        raise NanoqwenFormatError(f"cannot list {folder}: {e.strerror}") from None
    check_not_an_input(dst, [folder, *inputs])
    check_destination(dst)
    config = model_config(_read_json(folder / "config.json"))
    tokenizer_config = validate_tokenizer_config(_read_json(folder / "tokenizer_config.json"))
    generation_config = validate_generation_config(_read_json(folder / "generation_config.json", required=False))
    tokenizer_json = _read_text(folder / "tokenizer.json")
    where = open_checkpoint(folder)
    try:
        # Parsed last of the cheap checks: a 7 MB tokenizer takes a few hundred ms.
        if not isinstance(loads(tokenizer_json, "tokenizer.json"), dict):
            raise NanoqwenFormatError("tokenizer.json is not a JSON object")
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
