"""Check a .nanoqwen file's CRC32s on its first load, and remember that it passed.

A full check (NanoqwenFile.verify) reads every byte: about 2 s for a 1.1 GB file on the 2-core CI
machine. A model is loaded far more often than it changes, so `verify_once` checks a file the first time
and writes a small JSON record of what it checked: the file's size, mtime_ns, inode and device. A later
call whose file still has exactly that identity skips the check. Like make's timestamps this trusts the
file system: a byte that changes without touching the size, the mtime or the inode (a disk fault under
a file nobody rewrote) goes unnoticed after the first check; `verify_once(..., force=True)` (and
`nanoqwen-convert inspect --verify`) reads everything again.

The records live in a directory the caller chooses (nanoqwen-cli uses `$NANOQWEN_CACHE/verified`), one
file per model path, so a read-only model directory needs no sidecar and two processes never write the
same JSON document.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path

from .errors import NanoqwenFormatError
from .reader import open_model

RECORD_VERSION = 1


def _identity(path: Path) -> dict:
    try:
        st = os.stat(path)
    except OSError as e:
        raise NanoqwenFormatError(f"cannot open {path}: {e.strerror}") from None
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino, "device": st.st_dev}


def record_path(path, record_dir) -> Path:
    """Where the record of `path` lives: a hash of its resolved path, so any spelling of it finds it."""
    key = hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:24]
    return Path(record_dir) / f"{key}.json"


def _read_record(rec: Path) -> dict | None:
    try:
        data = json.loads(rec.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # no record, or a damaged one: either way, check the file
    return data if isinstance(data, dict) else None


def is_verified(path, record_dir) -> bool:
    """True when a record says `path`, exactly as it is now, passed the check."""
    path = Path(path)
    rec = _read_record(record_path(path, record_dir))
    return (
        rec is not None
        and rec.get("version") == RECORD_VERSION
        and rec.get("path") == str(path.resolve())
        and all(rec.get(k) == v for k, v in _identity(path).items())
    )


def verify_once(path, record_dir, *, force: bool = False) -> bool:
    """Check every tensor's CRC32 of `path` unless a record says it passed as it is now.

    Returns True when the file was read and checked now, False when the record made that unnecessary.
    A mismatch raises NanoqwenFormatError naming the file and the tensor; nothing is recorded then.
    """
    path = Path(path)
    if not force and is_verified(path, record_dir):
        return False
    before = _identity(path)
    try:
        with open_model(path) as model:
            model.verify()
    except NanoqwenFormatError as e:
        text = str(e)
        raise NanoqwenFormatError(text if str(path) in text else f"{path}: {text}") from None
    if _identity(path) == before:  # a file replaced while it was read is checked again next time
        _write_record(record_path(path, record_dir), {"version": RECORD_VERSION, "path": str(path.resolve()),
                                                      **before, "verified_at": time.time()})
    return True


def forget(path, record_dir) -> None:
    """Drop the record of `path` (the file was removed or replaced on purpose)."""
    record_path(path, record_dir).unlink(missing_ok=True)


def _write_record(rec: Path, data: dict) -> None:
    tmp = rec.with_name(f".{rec.name}.{os.getpid()}.tmp")
    try:
        rec.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data), encoding="utf-8")
        os.replace(tmp, rec)
    except OSError:
        # A read-only or full cache only costs a check on the next load, not this load.
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
