"""open_model: validate a .nanoqwen file completely, then serve zero-copy numpy views from one mmap.

Validation order follows docs/FORMAT.md "Validation": magic before any other read, then the fixed header
(the JSON length bounded before a byte of the JSON is touched), the JSON, the config, tokenizer_config and
generation_config, the quantization block, the tensor table against the file's size and against the
config, and (verify=True) every tensor's CRC32. Every failure is one NanoqwenFormatError naming it.
"""

import codecs
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
    validate_generation_config,
    validate_tokenizer_config,
)
from .quantize import dequantize_int4
from .strict import MAX_BYTES, check_disjoint, int_in, label, loads, open_regular, shape_nbytes, short
from .valueshuffle import unpack_valueshuffle

TOP_KEYS = {"config": dict, "quantization": dict, "tensors": list, "tokenizer_json": str,
            "tokenizer_config": dict, "generation_config": dict, "provenance": dict}
ENTRY_KEYS = ("name", "dtype", "shape", "offset", "nbytes", "crc32")
CRC_RE = re.compile(r"[0-9a-f]{8}")
CRC_CHUNK = 64 << 20  # bytes per zlib.crc32 call in verify(): one call per chunk of a memoryview, no copy


def check_fixed_header(fixed: bytes, size: int) -> int:
    """The 24-byte fixed header of a file of `size` bytes (fixed: its first min(24, size) bytes);
    returns N, the JSON length, known to be at most MAX_JSON and to fit in the file."""
    if size < len(MAGIC):
        raise NanoqwenFormatError(f"file is too short ({size} bytes) to hold the magic {MAGIC!r}")
    if fixed[:8] != MAGIC:
        raise NanoqwenFormatError(f"bad magic {fixed[:8]!r}: not a .nanoqwen file (want {MAGIC!r})")
    if size < FIXED_HEADER:
        raise NanoqwenFormatError(f"file is too short ({size} bytes) for the {FIXED_HEADER}-byte fixed header")
    version, flags, json_len = struct.unpack("<IIQ", fixed[8:FIXED_HEADER])
    if version != VERSION:
        raise NanoqwenFormatError(f"unknown format version {version} (this reader knows {VERSION})")
    if flags != 0:
        raise NanoqwenFormatError(f"unknown flags 0x{flags:08x} (v1 defines none)")
    if json_len > MAX_JSON:
        raise NanoqwenFormatError(f"JSON header length {json_len} exceeds the {MAX_JSON >> 20} MiB a v1 header "
                                  f"may have")
    if FIXED_HEADER + json_len > size:
        raise NanoqwenFormatError(f"JSON header length {json_len} runs past the end of the file ({size} bytes)")
    return json_len


def read_header(mm: mmap.mmap, json_len: int, size: int) -> tuple[dict, int]:
    """Parse and check the JSON header straight from the mapping; returns (header dict, data section start).

    No copy of the raw bytes is made: a NUL byte (never in JSON text, and what a hole in a sparse file
    reads as) is looked for first, in place, then the bytes are decoded from a view of the mapping into
    the one str that json parses."""
    end = FIXED_HEADER + json_len
    nul = mm.find(b"\0", FIXED_HEADER, end)
    if nul != -1:
        raise NanoqwenFormatError(f"JSON header is not valid JSON text: a NUL byte at offset {nul}")
    with memoryview(mm) as whole, whole[FIXED_HEADER:end] as raw:
        try:
            text, _ = codecs.utf_8_decode(raw, "strict", True)
        except UnicodeDecodeError as e:
            raise NanoqwenFormatError(f"JSON header is not valid UTF-8: {e.reason} at byte "
                                      f"{FIXED_HEADER + e.start}") from None
    header = loads(text, "JSON header")
    del text
    if not isinstance(header, dict):
        raise NanoqwenFormatError("JSON header is not a JSON object")
    for key, typ in TOP_KEYS.items():
        if not isinstance(header.get(key), typ):
            raise NanoqwenFormatError(f"JSON header: {key!r} missing or not a {typ.__name__}")
    data_start = align_up(end)
    if mm[end:min(data_start, size)].strip(b"\0"):
        raise NanoqwenFormatError("nonzero bytes in the padding between the JSON header and the data section")
    return header, data_start


def check_quantization(q: dict) -> None:
    """Exactly the v1 block, values and JSON types (true is not 1)."""
    if set(q) != set(QUANTIZATION) or any(type(q[k]) is not type(v) or q[k] != v for k, v in QUANTIZATION.items()):
        raise NanoqwenFormatError(f"unsupported quantization {short(q)} (v1 is exactly {QUANTIZATION})")


def check_tensor_table(header: dict, size: int, data_start: int) -> dict[str, dict]:
    """Every entry well-formed, inside the file, aligned, non-overlapping, and exactly what the config needs.

    Each integer is bounded (strict.shape_nbytes, MAX_BYTES) before any arithmetic uses it."""
    config = header["config"]
    table: dict[str, dict] = {}
    for i, entry in enumerate(header["tensors"]):
        if not isinstance(entry, dict) or set(entry) != set(ENTRY_KEYS):
            raise NanoqwenFormatError(f"tensor table entry {i} must have exactly the keys {ENTRY_KEYS}: {short(entry)}")
        name = entry["name"]
        if not isinstance(name, str) or name in table:
            raise NanoqwenFormatError(f"tensor table: bad or duplicate name {short(name)}")
        what = f"tensor {label(name)}"
        dtype, off, nb = entry["dtype"], entry["offset"], entry["nbytes"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise NanoqwenFormatError(f"{what}: unknown dtype {short(dtype)} (want one of {sorted(DTYPES)})")
        want = shape_nbytes(entry["shape"], DTYPES[dtype], what)
        for key, v in (("offset", off), ("nbytes", nb)):
            if not int_in(v, 0, MAX_BYTES):
                raise NanoqwenFormatError(f"{what}: {key} must be an integer in 0..2^62, got {short(v)}")
        if not isinstance(entry["crc32"], str) or not CRC_RE.fullmatch(entry["crc32"]):
            raise NanoqwenFormatError(f"{what}: crc32 must be 8 lowercase hex digits")
        if want != nb:
            raise NanoqwenFormatError(f"{what}: dtype {dtype} x shape {entry['shape']} = {want} bytes != nbytes {nb}")
        if off % ALIGN:
            raise NanoqwenFormatError(f"{what}: offset {off} is not aligned to {ALIGN} bytes")
        if off < data_start:
            raise NanoqwenFormatError(f"{what}: offset {off} lies inside the header (data starts at {data_start})")
        if off + nb > size:
            raise NanoqwenFormatError(f"{what}: bytes {off}..{off + nb} run past the end of the file ({size} bytes)")
        table[name] = entry
    check_disjoint([(e["offset"], e["offset"] + e["nbytes"], n) for n, e in table.items()], "tensors")
    expected = expected_tensors(config)
    names = {t.name for t in expected}
    for t in expected:
        if t.name not in table:
            raise NanoqwenFormatError(f"missing tensor {t.name}")
    for n in table:
        if n not in names:
            raise NanoqwenFormatError(f"unexpected tensor {label(n)} (not part of this config's model)")
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
        with memoryview(self._mm) as whole:
            for name, e in self._table.items():
                crc, end = 0, e["offset"] + e["nbytes"]
                for start in range(e["offset"], end, CRC_CHUNK):
                    with whole[start:min(start + CRC_CHUNK, end)] as chunk:
                        crc = zlib.crc32(chunk, crc)
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
    f, size = open_regular(path)
    mm = None
    try:
        json_len = check_fixed_header(os.pread(f.fileno(), FIXED_HEADER, 0), size)
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError, OverflowError) as e:
            raise NanoqwenFormatError(f"cannot map {path} ({size} bytes): {e}") from None
        header, data_start = read_header(mm, json_len, size)
        validate_config(header["config"])
        validate_tokenizer_config(header["tokenizer_config"])
        validate_generation_config(header["generation_config"])
        check_quantization(header["quantization"])
        table = check_tensor_table(header, size, data_start)
        model = NanoqwenFile(path, header, table, f, mm)
    except BaseException:
        if mm is not None:
            mm.close()
        f.close()
        raise
    if verify:
        try:
            model.verify()
        except BaseException:
            model.close()
            raise
    return model
