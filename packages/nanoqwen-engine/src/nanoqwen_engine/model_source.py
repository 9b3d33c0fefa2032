"""resolve_model: a .nanoqwen path, a local HF checkpoint folder, or a hub id -> a .nanoqwen file path.

An HF folder (or a hub id, downloaded first with huggingface_hub) is converted once into the cache
directory `$NANOQWEN_CACHE` (default ~/.cache/nanoqwen); later loads reuse the converted file. The cache
key hashes the source's absolute path and each file's name, size and mtime, so an updated checkpoint is
converted again. The conversion writes to a temporary name and renames, so an interrupted conversion
never leaves a file that looks complete.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from .errors import ModelFormatError, ModelNotFoundError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def cache_dir() -> Path:
    return Path(os.environ.get("NANOQWEN_CACHE") or Path.home() / ".cache" / "nanoqwen")


def _folder_key(folder: Path) -> str:
    h = hashlib.sha256(str(folder.resolve()).encode())
    for f in sorted(folder.iterdir()):
        if f.is_file() and (f.suffix in (".json", ".safetensors") or f.name.endswith(".model")):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _convert(folder: Path, dst: Path, progress: bool) -> None:
    # The function from the submodule: once nanoqwen_format.convert (the module) is imported, the package
    # attribute `nanoqwen_format.convert` names the module, not the function.
    from nanoqwen_format import NanoqwenFormatError
    from nanoqwen_format.convert import convert

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.stem}.tmp{os.getpid()}.nanoqwen")
    try:
        convert(folder, tmp, progress=progress)
        os.replace(tmp, dst)
    except NanoqwenFormatError as e:
        raise ModelFormatError(f"cannot convert {folder}: {e}") from e
    finally:
        if tmp.exists():
            tmp.unlink()


def _download(hub_id: str, progress: bool) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ModelNotFoundError(f"{hub_id!r} is not a local path and huggingface_hub is not installed") from e
    if not progress:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        return Path(snapshot_download(hub_id, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as e:  # network, auth, missing repo: many exception types, one meaning for the user
        raise ModelNotFoundError(f"cannot download {hub_id!r} from the Hugging Face hub: {type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''}") from e


def resolve_model(source: str | os.PathLike, progress: bool = True, cache: Path | None = None) -> Path:
    """The .nanoqwen file for source (converting and caching an HF checkpoint if needed)."""
    p = Path(source).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelNotFoundError(f"{p} is a folder without config.json: not a Hugging Face checkpoint")
        folder = p
        name = p.resolve().name
    elif _HUB_ID.match(str(source)) and not p.exists() and not str(source).startswith((".", "/", "~")):
        folder = _download(str(source), progress)
        name = str(source).replace("/", "--")
    else:
        raise ModelNotFoundError(f"{source}: no such .nanoqwen file or checkpoint folder, and not a hub id")
    dst = (cache or cache_dir()) / f"{name}-{_folder_key(folder)}.nanoqwen"
    if not dst.is_file():
        _convert(folder, dst, progress)
    return dst
