"""open_model: validate a .nanoqwen file completely, then serve zero-copy numpy views from one mmap.

Validation order follows docs/FORMAT.md "Validation": magic before any other read, then the fixed header,
the JSON, the config, the quantization block, the tensor table against the file's size and against the
config, and (verify=True) every tensor's CRC32. Every failure is one NanoqwenFormatError naming it.
"""

import json
import math
import mmap
import os
import re
import struct
import zlib
from pathlib import Path

import numpy as np

from .errors import NanoqwenFormatError
from .layout import (
    ALIGN,
    DTYPES,
    FIXED_HEADER,
    MAGIC,
    MAX_JSON,
    QUANTIZATION,
    VERSION,
    align_up,
    expected_tensors,
    validate_config,
)
from .quantize import dequantize_int4
from .valueshuffle import unpack_valueshuffle

TOP_KEYS = {"config": dict, "quantization": dict, "tensors": list, "tokenizer_json": str,
            "tokenizer_config": dict, "generation_config": dict, "provenance": dict}
ENTRY_KEYS = ("name", "dtype", "shape", "offset", "nbytes", "crc32")
CRC_RE = re.compile(r"[0-9a-f]{8}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _canon(obj) -> str:
    return json.dumps(obj, sort_keys=True)  # type-strict equality: true != 1 here


def read_header(f, size: int) -> tuple[dict, int]:
    """Parse and check the fixed header and the JSON; returns (header dict, data section start)."""
    if size < len(MAGIC):
        raise NanoqwenFormatError(f"file is too short ({size} bytes) to hold the magic {MAGIC!r}")
    magic = f.read(8)
    if magic != MAGIC:
        raise NanoqwenFormatError(f"bad magic {magic!r}: not a .nanoqwen file (want {MAGIC!r})")
    if size < FIXED_HEADER:
        raise NanoqwenFormatError(f"file is too short ({size} bytes) for the {FIXED_HEADER}-byte fixed header")
    version, flags, json_len = struct.unpack("<IIQ", f.read(16))
    if version != VERSION:
        raise NanoqwenFormatError(f"unknown format version {version} (this reader knows {VERSION})")
    if flags != 0:
        raise NanoqwenFormatError(f"unknown flags 0x{flags:08x} (v1 defines none)")
    if json_len > MAX_JSON or FIXED_HEADER + json_len > size:
        raise NanoqwenFormatError(f"JSON header length {json_len} runs past the end of the file ({size} bytes)")
    raw = f.read(json_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise NanoqwenFormatError(f"JSON header is not valid UTF-8 JSON: {str(e)[:120]}") from None
    if not isinstance(header, dict):
        raise NanoqwenFormatError("JSON header is not a JSON object")
    for key, typ in TOP_KEYS.items():
        if not isinstance(header.get(key), typ):
            raise NanoqwenFormatError(f"JSON header: {key!r} missing or not a {typ.__name__}")
    data_start = align_up(FIXED_HEADER + json_len)
    pad = f.read(min(data_start, size) - FIXED_HEADER - json_len)
    if pad.strip(b"\0"):
        raise NanoqwenFormatError("nonzero bytes in the padding between the JSON header and the data section")
    return header, data_start


def check_tensor_table(header: dict, size: int, data_start: int) -> dict[str, dict]:
    """Every entry well-formed, inside the file, aligned, non-overlapping, and exactly what the config needs."""
    config = header["config"]
    table: dict[str, dict] = {}
    for entry in header["tensors"]:
        if not isinstance(entry, dict) or set(entry) != set(ENTRY_KEYS):
            raise NanoqwenFormatError(f"tensor table entry must have exactly the keys {ENTRY_KEYS}: {str(entry)[:80]}")
        name = entry["name"]
        if not isinstance(name, str) or name in table:
            raise NanoqwenFormatError(f"tensor table: bad or duplicate name {name!r}")
        dtype, shape, off, nb = entry["dtype"], entry["shape"], entry["offset"], entry["nbytes"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise NanoqwenFormatError(f"tensor {name}: unknown dtype {dtype!r} (want one of {sorted(DTYPES)})")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise NanoqwenFormatError(f"tensor {name}: shape {shape!r} is not a list of non-negative integers")
        if not _is_int(off) or not _is_int(nb) or off < 0 or nb < 0:
            raise NanoqwenFormatError(f"tensor {name}: offset/nbytes must be non-negative integers")
        if not isinstance(entry["crc32"], str) or not CRC_RE.fullmatch(entry["crc32"]):
            raise NanoqwenFormatError(f"tensor {name}: crc32 must be 8 lowercase hex digits")
        if math.prod(shape) * DTYPES[dtype] != nb:
            raise NanoqwenFormatError(f"tensor {name}: dtype {dtype} x shape {shape} = "
                                      f"{math.prod(shape) * DTYPES[dtype]} bytes != nbytes {nb}")
        if off % ALIGN:
            raise NanoqwenFormatError(f"tensor {name}: offset {off} is not aligned to {ALIGN} bytes")
        if off < data_start:
            raise NanoqwenFormatError(f"tensor {name}: offset {off} lies inside the header (data starts at {data_start})")
        if off + nb > size:
            raise NanoqwenFormatError(f"tensor {name}: bytes {off}..{off + nb} run past the end of the file ({size} bytes)")
        table[name] = entry
    spans = sorted((e["offset"], e["offset"] + e["nbytes"], n) for n, e in table.items())
    for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:], strict=False):
        if start_b < end_a:
            raise NanoqwenFormatError(f"tensors {a} and {b} overlap")
    expected = expected_tensors(config)
    names = {t.name for t in expected}
    for t in expected:
        if t.name not in table:
            raise NanoqwenFormatError(f"missing tensor {t.name}")
    for n in table:
        if n not in names:
            raise NanoqwenFormatError(f"unexpected tensor {n} (not part of this config's model)")
    for t in expected:
        e = table[t.name]
        if e["dtype"] != t.dtype or tuple(e["shape"]) != t.shape:
            raise NanoqwenFormatError(f"tensor {t.name} is {e['dtype']} {e['shape']} but the config implies "
                                      f"{t.dtype} {list(t.shape)} (dims inconsistent with config)")
    return {t.name: table[t.name] for t in expected}  # file order


class NanoqwenFile:
    """A validated, memory-mapped .nanoqwen file. Use open_model() to get one; close() or `with`."""

    def __init__(self, path: Path, header: dict, table: dict[str, dict], f, mm: mmap.mmap):
        self.path = path
        self.header = header
        self.config: dict = header["config"]
        self.quantization: dict = header["quantization"]
        self.tokenizer_json: str = header["tokenizer_json"]
        self.tokenizer_config: dict = header["tokenizer_config"]
        self.generation_config: dict = header["generation_config"]
        self.provenance: dict = header["provenance"]
        self.tensor_names: list[str] = list(table)
        self._table = table
        self._f = f
        self._mm = mm

    def tensor_info(self, name: str) -> dict:
        """The table entry: name, dtype, shape, offset, nbytes, crc32."""
        if name not in self._table:
            raise NanoqwenFormatError(f"no tensor named {name!r} in {self.path.name}")
        return dict(self._table[name])

    def tensor(self, name: str) -> np.ndarray:
        """Zero-copy read-only view into the mapping (uint32 ValueShuffle words or float16)."""
        e = self.tensor_info(name)
        if self._mm is None:
            raise NanoqwenFormatError(f"{self.path.name} is closed")
        dt = np.dtype(e["dtype"]).newbyteorder("<")
        return np.frombuffer(self._mm, dtype=dt, count=math.prod(e["shape"]), offset=e["offset"]).reshape(e["shape"])

    def dequantize(self, hf_weight_name: str) -> np.ndarray:
        """float32 [N, K] of an HF weight: INT4 projections dequantized, float16 tensors widened
        (`lm_head.weight` of a tied model is the embedding)."""
        pre = hf_weight_name.removesuffix(".weight")
        if f"{pre}.qweight" in self._table:
            return dequantize_int4(unpack_valueshuffle(self.tensor(f"{pre}.qweight")), self.tensor(f"{pre}.scales"))
        if hf_weight_name == "lm_head.weight" and self.config["tie_word_embeddings"]:
            hf_weight_name = "model.embed_tokens.weight"
        return self.tensor(hf_weight_name).astype(np.float32)

    def verify(self) -> None:
        """Check every tensor's CRC32 against the table."""
        for name, e in self._table.items():
            crc = 0
            for start in range(e["offset"], e["offset"] + e["nbytes"], 64 << 20):
                crc = zlib.crc32(self._mm[start:min(start + (64 << 20), e["offset"] + e["nbytes"])], crc)
            if f"{crc:08x}" != e["crc32"]:
                raise NanoqwenFormatError(f"tensor {name}: CRC32 mismatch (file {crc:08x}, table {e['crc32']})")

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # views handed out still use the mapping; it is unmapped when the last one goes
            self._mm = None
            self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        c = self.config
        return (f"NanoqwenFile({str(self.path)!r}, layers={c['num_hidden_layers']}, hidden={c['hidden_size']}, "
                f"tensors={len(self.tensor_names)})")


def open_model(path, verify: bool = False) -> NanoqwenFile:
    """Validate and map a .nanoqwen file; verify=True also checks every tensor's CRC32."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise NanoqwenFormatError(f"cannot open {path}: {e.strerror}") from None
    try:
        size = os.fstat(f.fileno()).st_size
        header, data_start = read_header(f, size)
        validate_config(header["config"])
        if _canon(header["quantization"]) != _canon(QUANTIZATION):
            raise NanoqwenFormatError(f"unsupported quantization {str(header['quantization'])[:200]} "
                                      f"(v1 is exactly {QUANTIZATION})")
        table = check_tensor_table(header, size, data_start)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        model = NanoqwenFile(path, header, table, f, mm)
    except BaseException:
        f.close()
        raise
    if verify:
        try:
            model.verify()
        except BaseException:
            model.close()
            raise
    return model
