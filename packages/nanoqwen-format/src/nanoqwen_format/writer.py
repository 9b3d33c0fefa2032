"""Streaming .nanoqwen writer: the tensor table is laid out up front from the shared tensor list, tensors are
written chunk by chunk (CRC32 as they go), the header is written last, and the file appears atomically."""

import json
import os
import queue
import struct
import threading
import zlib
from pathlib import Path

import numpy as np

from .errors import NanoqwenFormatError
from .layout import FIXED_HEADER, MAGIC, QUANTIZATION, VERSION, TensorSpec, align_up

# Room left in the JSON header for what is only known at the end (CRCs are fixed-width; the converter's
# quantization-error summary in provenance is not). The JSON text is padded with spaces to its length.
HEADER_SLACK = 16384


def header_bytes(header: dict, json_len: int | None = None) -> bytes:
    """Fixed header + JSON (space-padded to json_len) + zero padding to the next 4096 boundary."""
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    if json_len is not None:
        if len(text) > json_len:
            raise NanoqwenFormatError(f"header grew past its reserved {json_len} bytes")
        text += b" " * (json_len - len(text))
    fixed = MAGIC + struct.pack("<IIQ", VERSION, 0, len(text))
    raw = fixed + text
    return raw + b"\0" * (align_up(len(raw)) - len(raw))


class NanoqwenWriter:
    """with NanoqwenWriter(dst, config, tensors, tokenizer_json=..., ...) as w: w.write_tensor(name, chunks)

    Tensors must be written in the order of `tensors`, each fully. The output is a temporary file in the
    destination's folder, renamed over `dst` only when every tensor is complete; any exception (also
    KeyboardInterrupt) removes it, so no partial file is ever left under `dst`.
    """

    def __init__(self, dst, config: dict, tensors: list[TensorSpec], *, tokenizer_json: str,
                 tokenizer_config: dict, generation_config: dict, provenance: dict):
        self.dst = Path(dst)
        self.specs = list(tensors)
        self.header = {
            "config": config,
            "quantization": dict(QUANTIZATION),
            "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "offset": 0,
                         "nbytes": t.nbytes, "crc32": "00000000"} for t in self.specs],
            "tokenizer_config": tokenizer_config,
            "generation_config": generation_config,
            "provenance": provenance,
            "tokenizer_json": tokenizer_json,
        }
        # Offsets depend on the JSON length, which depends on the offsets' digits: lay out with a
        # reserved length that already counts the widest offsets, then keep that length.
        probe = len(json.dumps(self.header, ensure_ascii=False, separators=(",", ":")).encode())
        self.json_len = probe + HEADER_SLACK + 24 * len(self.specs)
        offset = align_up(FIXED_HEADER + self.json_len)
        for entry in self.header["tensors"]:
            entry["offset"] = offset
            offset = align_up(offset + entry["nbytes"])
        self.size = self.header["tensors"][-1]["offset"] + self.header["tensors"][-1]["nbytes"]
        self._next = 0  # index of the next tensor to write
        self._tmp = self.dst.with_name(f".{self.dst.name}.{os.getpid()}.tmp")
        self._f = None
        # Write-behind: a thread does the file writes and CRCs (both release the GIL) while the caller
        # computes the next chunk. Two chunks in flight bound the extra memory (chunks are <= ~64 MB).
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        self._thread = threading.Thread(target=self._drain, name="nanoqwen-writer", daemon=True)
        self._error: BaseException | None = None

    def __enter__(self):
        try:
            self.dst.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self._tmp, "wb")
        except OSError as e:
            raise NanoqwenFormatError(f"cannot write {self.dst}: {e.strerror or e}") from None
        self._thread.start()
        return self

    def _drain(self) -> None:
        """Worker: items are (entry, offset) to start a tensor, bytes-like data, or None to stop."""
        crc, entry = 0, None
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue  # keep draining so the producer never blocks on a full queue
            try:
                if isinstance(item, tuple):
                    if entry is not None:
                        entry["crc32"] = f"{crc:08x}"
                    entry, crc = item[0], 0
                    self._f.seek(item[1])
                else:
                    crc = zlib.crc32(item, crc)
                    self._f.write(item)
            except BaseException as e:  # handed to the producer, raised there
                self._error = e
        if entry is not None and self._error is None:
            entry["crc32"] = f"{crc:08x}"

    def _put(self, item) -> None:
        if self._error is not None:
            raise NanoqwenFormatError(f"writing {self._tmp.name} failed: {self._error}") from self._error
        self._queue.put(item)

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def write_tensor(self, name: str, chunks) -> None:
        """chunks: an iterable of arrays of the tensor's dtype whose bytes, in order, are the tensor."""
        if self._next >= len(self.specs) or self.specs[self._next].name != name:
            want = self.specs[self._next].name if self._next < len(self.specs) else "nothing"
            raise NanoqwenFormatError(f"writer: got tensor {name}, expected {want}")
        spec, entry = self.specs[self._next], self.header["tensors"][self._next]
        self._put((entry, entry["offset"]))
        written = 0
        for chunk in chunks:
            chunk = np.ascontiguousarray(chunk)  # the queue keeps it alive until written
            if chunk.dtype != np.dtype(spec.dtype).newbyteorder("<"):
                raise NanoqwenFormatError(f"writer: {name} chunk has dtype {chunk.dtype}, want {spec.dtype}")
            data = memoryview(chunk).cast("B")
            written += len(data)
            self._put(data)
        if written != spec.nbytes:
            raise NanoqwenFormatError(f"writer: {name} got {written} bytes, want {spec.nbytes}")
        self._next += 1

    def __exit__(self, exc_type, exc, tb):
        try:
            self._stop()  # every queued chunk written, every CRC in the table
            if exc_type is None and self._error is not None:
                raise NanoqwenFormatError(f"writing {self._tmp.name} failed: {self._error}") from self._error
            if exc_type is None:
                if self._next != len(self.specs):
                    raise NanoqwenFormatError(f"writer: tensor {self.specs[self._next].name} never written")
                head = header_bytes(self.header, self.json_len)
                assert len(head) <= self.header["tensors"][0]["offset"]
                self._f.seek(0)
                self._f.write(head)
                self._f.truncate(self.size)
                self._f.close()
                os.replace(self._tmp, self.dst)
        finally:
            if not self._f.closed:
                self._f.close()
            if self._tmp.exists():
                self._tmp.unlink()
        return False
