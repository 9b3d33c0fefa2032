"""Minimal streaming safetensors reader and writer.

Why not `safetensors.safe_open`: its numpy backend cannot represent bfloat16 (TypeError: data type
'bfloat16' not understood, safetensors 0.8), and Qwen checkpoints are bf16. The format is tiny (u64 header
length, JSON {name: {dtype, shape, data_offsets}}, raw little-endian data), so we read rows with plain file
reads: no mmap pages pile up in the converter's RSS, which keeps a 7B conversion under 3 GB.
"""

import json
import math
import struct
from pathlib import Path

import numpy as np

from .errors import NanoqwenFormatError
from .strict import check_disjoint, int_in, label, loads, open_regular, shape_nbytes, short

ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}
NAMES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
ENTRY_KEYS = ("dtype", "shape", "data_offsets")
MAX_HEADER = 100_000_000  # the safetensors library's own bound on the header (a 7B checkpoint's is ~30 KB)


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns -> float32 (exact: bf16 is the top half of a float32)."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bf16 bit patterns, round to nearest even (finite inputs)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((b + np.uint32(0x7FFF) + ((b >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


class SafetensorsFile:
    """The header of one .safetensors file, checked as strictly as the .nanoqwen reader checks its table
    (strict.py: bounded shapes, exact sizes, in bounds, disjoint); rows are read on demand as float32."""

    def __init__(self, path: Path):
        self.path = Path(path)
        where = self.path.name
        self._f, size = open_regular(self.path, where)
        try:
            self.tensors = self._read_table(where, size)
        except BaseException:
            self._f.close()
            raise

    def _read_table(self, where: str, size: int) -> dict[str, dict]:
        try:
            first = self._f.read(8)
            if len(first) < 8:
                raise NanoqwenFormatError(f"{where}: not a safetensors file ({size} bytes, too short)")
            (n,) = struct.unpack("<Q", first)
            if n > min(size - 8, MAX_HEADER):
                raise NanoqwenFormatError(f"{where}: header length {n} runs past the end of the file "
                                          f"({size} bytes) or past {MAX_HEADER} bytes")
            raw = self._f.read(n)
        except OSError as e:
            raise NanoqwenFormatError(f"{where}: cannot read ({e.strerror or e})") from None
        header = loads(raw, f"{where}: header")
        if not isinstance(header, dict):
            raise NanoqwenFormatError(f"{where}: header is not a JSON object")
        base, data_size = 8 + n, size - 8 - n
        tensors, spans = {}, []
        for name, e in header.items():
            if name == "__metadata__":
                if not isinstance(e, dict):
                    raise NanoqwenFormatError(f"{where}: __metadata__ must be a JSON object, got {short(e)}")
                continue
            what = f"{where}: tensor {label(name)}"
            if not isinstance(e, dict) or set(e) != set(ENTRY_KEYS):
                raise NanoqwenFormatError(f"{what} must be an object with exactly the keys {', '.join(ENTRY_KEYS)}: "
                                          f"{short(e)}")
            dtype = e["dtype"]
            if not isinstance(dtype, str) or dtype not in ITEMSIZE:
                raise NanoqwenFormatError(f"{what} has dtype {label(dtype)}; "
                                          f"only BF16, F16 and F32 checkpoints are supported")
            nbytes = shape_nbytes(e["shape"], ITEMSIZE[dtype], what)
            offs = e["data_offsets"]
            if not (isinstance(offs, list) and len(offs) == 2 and all(int_in(o, 0, data_size) for o in offs)
                    and offs[0] <= offs[1]):
                raise NanoqwenFormatError(f"{what}: data_offsets {short(offs)} must be two integers "
                                          f"0 <= begin <= end <= {data_size} (the data's size)")
            if offs[1] - offs[0] != nbytes:
                raise NanoqwenFormatError(f"{what}: data_offsets span {offs[1] - offs[0]} bytes but {dtype} x "
                                          f"shape {e['shape']} is {nbytes}")
            spans.append((offs[0], offs[1], name))
            tensors[name] = {"dtype": dtype, "shape": tuple(e["shape"]), "start": base + offs[0]}
        check_disjoint(spans, f"{where}: tensors")
        return tensors

    def read_rows(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """float32 copy of rows [start, stop) of a tensor (the whole tensor if it is 1-D)."""
        e = self.tensors[name]
        shape, item = e["shape"], ITEMSIZE[e["dtype"]]
        stop = shape[0] if stop is None else stop
        row = math.prod(shape[1:]) * item
        try:
            self._f.seek(e["start"] + start * row)
            raw = self._f.read((stop - start) * row)
        except OSError as err:
            raise NanoqwenFormatError(f"{self.path.name}: cannot read tensor {name} ({err.strerror or err})") from None
        if len(raw) != (stop - start) * row:
            raise NanoqwenFormatError(f"{self.path.name}: tensor {name} is truncated")
        out_shape = (stop - start, *shape[1:])
        if e["dtype"] == "BF16":
            return bf16_to_f32(np.frombuffer(raw, "<u2")).reshape(out_shape)
        return np.frombuffer(raw, "<f2" if e["dtype"] == "F16" else "<f4").astype(np.float32).reshape(out_shape)

    def close(self):
        self._f.close()


class SafetensorsWriter:
    """Streams tensors (float32 chunks, converted to `dtype`) into one .safetensors file, in spec order."""

    def __init__(self, path: Path, specs: list[tuple[str, tuple[int, ...]]], dtype: str):
        if dtype not in NAMES:
            raise NanoqwenFormatError(f"unsupported checkpoint dtype {dtype!r} (want one of {sorted(NAMES)})")
        self.dtype, code = dtype, NAMES[dtype]
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in specs:
            n = math.prod(shape) * ITEMSIZE[code]
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # data 8-byte aligned, as the reference writer does
        self.total = off
        self._f = open(path, "wb")
        self._f.write(struct.pack("<Q", len(text)) + text)

    def write(self, chunk: np.ndarray) -> None:
        if self.dtype == "bfloat16":
            data = f32_to_bf16(chunk)
        else:
            data = np.ascontiguousarray(chunk, dtype="<f2" if self.dtype == "float16" else "<f4")
        self._f.write(memoryview(data).cast("B"))

    def close(self):
        self._f.close()
