"""Streaming .nanoqwen writer: the tensor table is laid out up front from the shared tensor list, tensors are
written chunk by chunk (CRC32 as they go), the header is written last, and the file appears atomically.

Output paths: the file is written under a temporary name `.NAME.PID.tmp` in the destination's folder and
renamed over the destination once complete and re-opened by the reader. An existing destination must be a
regular file (a device node or a folder is refused, never replaced); missing parent folders are created
and removed again if the write fails. A temporary left by a killed writer (its PID no longer runs on this
host) is removed by the next writer into that folder.
"""

import json
import os
import queue
import re
import stat
import struct
import threading
import zlib
from pathlib import Path

import numpy as np

from .errors import NanoqwenFormatError
from .layout import (
    FIXED_HEADER,
    MAGIC,
    MAX_JSON,
    QUANTIZATION,
    VERSION,
    TensorSpec,
    align_up,
    validate_config,
    validate_generation_config,
    validate_tokenizer_config,
)

# Room left in the JSON header for what is only known at the end (CRCs are fixed-width; the converter's
# quantization-error summary in provenance is not). The JSON text is padded with spaces to its length.
HEADER_SLACK = 16384
# `.NAME.PID.tmp`; NAME may itself be such a name (a caller writing to its own temporary), see temp_path.
TEMP_RE = re.compile(r"^\.(?P<stem>.+)\.(?P<pid>[0-9]{1,10})\.tmp$", re.DOTALL)
PID_MAX = 1 << 22  # Linux's largest pid_max


def json_text(header: dict) -> bytes:
    """The header's JSON text, UTF-8, compact; NaN/Infinity or a non-JSON value (e.g. in a caller's
    provenance) is refused here rather than written."""
    try:
        return json.dumps(header, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise NanoqwenFormatError(f"header is not writable as JSON (provenance or config): {e}") from None


def header_bytes(header: dict, json_len: int | None = None) -> bytes:
    """Fixed header + JSON (space-padded to json_len) + zero padding to the next 4096 boundary."""
    text = json_text(header)
    if json_len is not None:
        if len(text) > json_len:
            raise NanoqwenFormatError(f"header grew past its reserved {json_len} bytes")
        text += b" " * (json_len - len(text))
    fixed = MAGIC + struct.pack("<IIQ", VERSION, 0, len(text))
    raw = fixed + text
    return raw + b"\0" * (align_up(len(raw)) - len(raw))


def name_max(folder: Path) -> int:
    """The longest file name (bytes) the folder's file system takes (255 where it cannot be asked)."""
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def temp_path(dst: Path) -> Path:
    """`.NAME.PID.tmp` beside dst, within NAME_MAX, never nested: a dst that already is a temporary
    name (`.x.nanoqwen.PID.tmp`, a caller's own) gives `.x.nanoqwen~.PID.tmp`, not `..x.nanoqwen.PID.tmp.PID.tmp`.
    NAME is shortened (whole characters) when dst's name is near NAME_MAX."""
    stem = dst.name
    while m := TEMP_RE.match(stem):
        stem = m["stem"]
    stem = stem.lstrip(".") or "x"
    tail = f".{os.getpid()}.tmp"
    room = name_max(dst.parent if dst.parent.is_dir() else Path(".")) - len(f".~{tail}")
    while len(os.fsencode(stem)) > room:
        stem = stem[:-1]
    name = f".{stem}{tail}"
    return dst.with_name(name if name != dst.name else f".{stem}~{tail}")


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep_stale_temps(folder: Path) -> list[str]:
    """Remove the temporaries writers that no longer run left in `folder` (SIGKILL, power loss); returns
    their names. A file is taken only if all of these hold: its name is `.NAME.PID.tmp`, PID is not this
    process and runs no longer on this host, it is a regular file, and it is empty or starts with the magic
    or with 8 zero bytes (what this writer puts there first; earlier writers left zeros until the end)."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        m = TEMP_RE.match(entry.name)
        if not m:
            continue
        pid = int(m["pid"])
        if not 0 < pid < PID_MAX or pid == os.getpid() or _pid_running(pid):
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            with open(entry.path, "rb") as f:
                head = f.read(8)
            if head in (b"", MAGIC, bytes(8)):
                os.unlink(entry.path)
                removed.append(entry.name)
        except OSError:
            continue  # gone meanwhile, or not ours to remove
    return removed


def check_destination(dst: Path) -> None:
    """dst may be written: its name fits the file system, and if it exists it is a regular file."""
    if len(os.fsencode(dst.name)) > name_max(dst.parent if dst.parent.is_dir() else Path(".")):
        raise NanoqwenFormatError(f"cannot write {dst}: the file name is longer than the file system allows")
    try:
        st = os.stat(dst)
    except FileNotFoundError:
        return
    except OSError as e:
        raise NanoqwenFormatError(f"cannot write {dst}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise NanoqwenFormatError(f"cannot write {dst}: it exists and is not a regular file (never replaced)")


def check_not_an_input(dst: Path, sources) -> None:
    """Refuse a destination that is one of the input files or lies inside an input folder (after symlinks:
    a Hugging Face snapshot's files are links into its blob store)."""
    try:
        out = Path(dst).resolve()
        resolved = [Path(src).resolve() for src in sources]
    except (OSError, RuntimeError) as e:  # a symlink loop (RuntimeError before Python 3.13)
        raise NanoqwenFormatError(f"cannot resolve the output or source path: {e}") from None
    for src in resolved:
        if out == src or (src.is_dir() and out.is_relative_to(src)):
            raise NanoqwenFormatError(f"output {dst} would overwrite or lie inside the source {src}; "
                                      f"write it somewhere else")


def _make_parents(folder: Path) -> list[Path]:
    """mkdir -p; returns the folders it created, outermost first, so a failed write can remove them."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        if folder.parent == folder:
            break
        folder = folder.parent
    created = []
    try:
        for d in reversed(missing):
            d.mkdir()
            created.append(d)
    except OSError as e:
        _remove_dirs(created)
        raise NanoqwenFormatError(f"cannot create {d}: {e.strerror}") from None
    return created


def _remove_dirs(created: list[Path]) -> None:
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            break  # not empty any more (someone else wrote there): leave it and its parents


class NanoqwenWriter:
    """with NanoqwenWriter(dst, config, tensors, tokenizer_json=..., ...) as w: w.write_tensor(name, chunks)

    Tensors must be written in the order of `tensors`, each fully. The output is a temporary file in the
    destination's folder (temp_path), renamed over `dst` only when every tensor is complete and the
    reader opens it; any exception (also KeyboardInterrupt) removes it and the folders this writer
    created, so no partial file is ever left under `dst`.
    """

    def __init__(self, dst, config: dict, tensors: list[TensorSpec], *, tokenizer_json: str,
                 tokenizer_config: dict, generation_config: dict, provenance: dict):
        self.dst = Path(dst)
        self.specs = list(tensors)
        # The inputs the reader checks are checked here too, so this writer never writes a file the reader
        # refuses (the finished file is also re-opened before it is renamed into place).
        validate_config(config)
        validate_tokenizer_config(tokenizer_config)
        validate_generation_config(generation_config)
        if not isinstance(tokenizer_json, str) or not isinstance(provenance, dict):
            raise NanoqwenFormatError("writer: tokenizer_json must be a str and provenance a dict")
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
        probe = len(json_text(self.header))
        self.json_len = probe + HEADER_SLACK + 24 * len(self.specs)
        if self.json_len > MAX_JSON:
            raise NanoqwenFormatError(f"the header would take {self.json_len / 2**20:.1f} MiB, more than the "
                                      f"{MAX_JSON >> 20} MiB a v1 file allows (tokenizer.json is "
                                      f"{len(tokenizer_json.encode()) / 2**20:.1f} MiB)")
        offset = align_up(FIXED_HEADER + self.json_len)
        for entry in self.header["tensors"]:
            entry["offset"] = offset
            offset = align_up(offset + entry["nbytes"])
        self.size = self.header["tensors"][-1]["offset"] + self.header["tensors"][-1]["nbytes"]
        self._next = 0  # index of the next tensor to write
        self._tmp = temp_path(self.dst)
        self._f = None
        self._created: list[Path] = []  # parent folders this writer made (removed again on failure)
        # Write-behind: a thread does the file writes and CRCs (both release the GIL) while the caller
        # computes the next chunk. Two chunks in flight bound the extra memory (chunks are <= ~64 MB).
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        self._thread = threading.Thread(target=self._drain, name="nanoqwen-writer", daemon=True)
        self._error: BaseException | None = None

    def __enter__(self):
        check_destination(self.dst)
        self._created = _make_parents(self.dst.parent)
        try:
            sweep_stale_temps(self.dst.parent)
            self._f = open(self._tmp, "wb")
            self._f.write(MAGIC)  # marks the temporary as this writer's (sweep_stale_temps); header comes last
        except OSError as e:
            self._cleanup()
            raise NanoqwenFormatError(f"cannot write {self.dst}: {e.strerror or e}") from None
        self._thread.start()
        return self

    def _cleanup(self) -> None:
        if self._f is not None and not self._f.closed:
            self._f.close()
        self._tmp.unlink(missing_ok=True)
        _remove_dirs(self._created)

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
                self._self_check()
                os.replace(self._tmp, self.dst)
                self._created = []  # the folders now hold the file
        finally:
            self._cleanup()
        return False

    def _self_check(self) -> None:
        """The finished temporary opens with the reader (structure, not CRCs: those were computed here)."""
        from .reader import open_model
        try:
            open_model(self._tmp).close()
        except NanoqwenFormatError as e:
            raise NanoqwenFormatError(f"internal error: the file written does not pass the reader: {e}") from e
