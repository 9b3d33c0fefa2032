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

ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}
NAMES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns -> float32 (exact: bf16 is the top half of a float32)."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bf16 bit patterns, round to nearest even (finite inputs)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((b + np.uint32(0x7FFF) + ((b >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


class SafetensorsFile:
    """The header of one .safetensors file; rows of a tensor are read on demand as float32."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self._f = open(self.path, "rb")
            size = self.path.stat().st_size
            (n,) = struct.unpack("<Q", self._f.read(8))
            if n > min(size - 8, 1 << 28):
                raise ValueError(f"header length {n} past end of file")
            header = json.loads(self._f.read(n))
        except (OSError, ValueError, struct.error) as e:
            raise NanoqwenFormatError(f"{self.path.name}: not a readable safetensors file ({e})") from None
        self._base = 8 + n
        self.tensors: dict[str, dict] = {}
        for name, e in header.items():
            if name == "__metadata__":
                continue
            dtype = e.get("dtype") if isinstance(e, dict) else None
            if dtype not in ITEMSIZE:
                raise NanoqwenFormatError(f"{self.path.name}: tensor {name} has dtype {dtype}; "
                                          f"only BF16, F16 and F32 checkpoints are supported")
            start, end = e["data_offsets"]
            if end - start != math.prod(e["shape"]) * ITEMSIZE[dtype] or self._base + end > size:
                raise NanoqwenFormatError(f"{self.path.name}: tensor {name} has inconsistent data_offsets")
            self.tensors[name] = {"dtype": dtype, "shape": tuple(e["shape"]), "start": self._base + start}

    def read_rows(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """float32 copy of rows [start, stop) of a tensor (the whole tensor if it is 1-D)."""
        e = self.tensors[name]
        shape, item = e["shape"], ITEMSIZE[e["dtype"]]
        stop = shape[0] if stop is None else stop
        row = math.prod(shape[1:]) * item
        self._f.seek(e["start"] + start * row)
        raw = self._f.read((stop - start) * row)
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
