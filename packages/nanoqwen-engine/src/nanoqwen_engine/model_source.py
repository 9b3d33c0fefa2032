"""The model cache: a .nanoqwen path, a cached model's name, a local HF checkpoint folder or a hub id -> a
.nanoqwen file path (converting once), and the listing, pulling and removal of cached models.

The cache directory is `$NANOQWEN_CACHE` (default ~/.cache/nanoqwen). Converted models get readable
names: a hub id's is the id with `/` spelled `--` (Qwen/Qwen2.5-Coder-7B-Instruct ->
`Qwen--Qwen2.5-Coder-7B-Instruct.nanoqwen`), a local folder's is the folder's name (with 8 hex digits
of its path's hash when another source already has that name). Beside each, `<name>.json` records the
source, its kind (hub, folder), the checkpoint key (each file's name, size and mtime), the hub revision,
where the download sits in the Hugging Face cache, and when the model was converted and last used.

- A hub id already in the cache is used as it is, without asking the network: `pull_model` asks the hub
  for its newest revision and converts again when that changed (ollama's `pull` semantics).
- A local folder is converted again, under the same name, when its files change (the key).
- The converter writes to a temporary name and renames, so an interrupted conversion never leaves a
  file that looks complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ModelFormatError, ModelNotFoundError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
SUFFIX = ".nanoqwen"


def cache_dir() -> Path:
    return Path(os.environ.get("NANOQWEN_CACHE") or Path.home() / ".cache" / "nanoqwen")


def verified_dir(cache: Path | None = None) -> Path:
    """Where the records of passed CRC checks live (nanoqwen_format.integrity)."""
    return (cache or cache_dir()) / "verified"


def is_hub_id(source) -> bool:
    s = str(source)
    return bool(_HUB_ID.match(s)) and not s.startswith((".", "/", "~")) and not Path(s).expanduser().exists()


def hub_name(hub_id: str) -> str:
    """The cache name of a hub id: Qwen/Qwen2.5-Coder-7B-Instruct -> Qwen--Qwen2.5-Coder-7B-Instruct."""
    return hub_id.replace("/", "--")


@dataclass
class Resolved:
    path: Path  # the .nanoqwen file
    converted: bool = False  # converted by this call
    meta: dict = field(default_factory=dict)  # the cache's record of it ({} for a file outside the cache)
    note: str | None = None  # what a pull found out (up to date, hub unreachable)


@dataclass
class CachedModel:
    name: str
    path: Path
    size: int
    source: str | None  # hub id, folder path, "synthetic", or what the file's provenance says
    kind: str  # hub, folder, or file (a .nanoqwen placed in the cache: a synthetic model, an older cache entry)
    quantization: str | None
    converted_at: float | None
    last_used: float | None
    error: str | None = None  # set when the file's header cannot be read


# -- metadata beside each cached model --


def meta_path(model: Path) -> Path:
    return model.with_suffix(".json")


def read_meta(model: Path) -> dict:
    try:
        data = json.loads(meta_path(model).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_meta(model: Path, meta: dict) -> None:
    dst = meta_path(model)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(meta, indent=1), encoding="utf-8")
        os.replace(tmp, dst)
    except OSError:  # a read-only cache loses the bookkeeping, not the model
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def _in_cache(path: Path, cache: Path) -> bool:
    try:
        return path.resolve().parent == cache.resolve()
    except OSError:
        return False


def touch(path: Path, cache: Path | None = None) -> None:
    """Record that a cached model was used now (for `models`' last-used column)."""
    cache = cache or cache_dir()
    if path.suffix == SUFFIX and _in_cache(path, cache):
        _write_meta(path, {**read_meta(path), "last_used": time.time()})


# -- resolving a source --


def _folder_key(folder: Path) -> str:
    h = hashlib.sha256(str(folder.resolve()).encode())
    for f in sorted(folder.iterdir()):
        if f.is_file() and (f.suffix in (".json", ".safetensors") or f.name.endswith(".model")):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _safe_name(name: str) -> str:
    return re.sub(r"[^\w.-]", "_", name).strip(".") or "model"


def _cache_path(cache: Path, base: str, source: str) -> Path:
    """cache/<base>.nanoqwen unless another source owns that name; then <base>-<hash of source>."""
    path = cache / f"{_safe_name(base)}{SUFFIX}"
    owner = read_meta(path).get("source")
    if owner == source or (owner is None and not path.exists()):
        return path
    return cache / f"{_safe_name(base)}-{hashlib.sha256(source.encode()).hexdigest()[:8]}{SUFFIX}"


def _convert(folder: Path, dst: Path, progress: bool) -> None:
    from nanoqwen_format import NanoqwenFormatError
    from nanoqwen_format.converter import convert

    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        convert(folder, dst, progress=progress)
    except NanoqwenFormatError as e:
        raise ModelFormatError(f"cannot convert {folder}: {e}") from e


def _download(hub_id: str, progress: bool, revision: str | None = None) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ModelNotFoundError(f"{hub_id!r} is not a local path and huggingface_hub is not installed") from e
    if not progress:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    kwargs = {"revision": revision} if revision else {}
    try:
        return Path(snapshot_download(hub_id, allow_patterns=["*.json", "*.safetensors"], **kwargs))
    except Exception as e:  # network, auth, missing repo: many exception types, one meaning for the user
        raise ModelNotFoundError(f"cannot download {hub_id!r} from the Hugging Face hub: {type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''}") from e


def _find_cached(name: str, cache: Path) -> Path | None:
    """A cached model called `name` (with or without .nanoqwen, or its hub id), or None."""
    stem = hub_name(name) if "/" in name else name
    stem = stem.removesuffix(SUFFIX)
    if not stem or "/" in stem or stem.startswith("."):
        return None
    path = cache / f"{stem}{SUFFIX}"
    return path if path.is_file() else None


def _convert_folder(folder: Path, dst: Path, meta: dict, progress: bool, force: bool = False) -> Resolved:
    key = _folder_key(folder)
    old = read_meta(dst)
    if dst.is_file() and old.get("key") == key and not force:
        return Resolved(dst, False, old)
    _convert(folder, dst, progress)
    now = time.time()
    meta = {**meta, "key": key, "converted_at": now, "last_used": now}
    _write_meta(dst, meta)
    return Resolved(dst, True, meta)


def _from_folder(folder: Path, cache: Path, progress: bool, force: bool = False) -> Resolved:
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"{folder} is a folder without config.json: not a Hugging Face checkpoint")
    src = str(folder.resolve())
    dst = _cache_path(cache, folder.resolve().name, src)
    return _convert_folder(folder, dst, {"source": src, "kind": "folder"}, progress, force)


def resolve(source, progress: bool = True, cache: Path | None = None) -> Resolved:
    """The .nanoqwen file for `source`, converting and caching an HF checkpoint when needed."""
    cache = cache or cache_dir()
    p = Path(source).expanduser()
    if p.is_file():
        touch(p, cache)
        return Resolved(p, False, read_meta(p) if _in_cache(p, cache) else {})
    if p.is_dir():
        return _from_folder(p, cache, progress)
    cached = _find_cached(str(source), cache)
    if cached is not None:
        touch(cached, cache)
        return Resolved(cached, False, read_meta(cached))
    if str(source).endswith(SUFFIX):
        raise ModelNotFoundError(f"{source}: no such file")
    if is_hub_id(source):
        return _pull_hub(str(source), progress, cache, revision=None)
    raise ModelNotFoundError(f"{source}: no such .nanoqwen file, cached model or checkpoint folder, and not a "
                             "hub id (owner/name)")


def resolve_model(source: str | os.PathLike, progress: bool = True, cache: Path | None = None) -> Path:
    """The .nanoqwen file for source (converting and caching an HF checkpoint if needed)."""
    return resolve(source, progress, cache).path


def _pull_hub(hub_id: str, progress: bool, cache: Path, revision: str | None, force: bool = False) -> Resolved:
    folder = _download(hub_id, progress, revision)
    dst = _cache_path(cache, hub_name(hub_id), hub_id)
    meta = {"source": hub_id, "kind": "hub", "revision": folder.name, "download_dir": str(folder.parent.parent)}
    return _convert_folder(folder, dst, meta, progress, force)


def _latest_revision(hub_id: str) -> tuple[str | None, str | None]:
    """(the hub's newest commit of hub_id, None) or (None, why it could not be asked)."""
    try:
        from huggingface_hub import HfApi

        return HfApi().model_info(hub_id).sha, None
    except Exception as e:  # offline mode, no network, missing repo: the caller decides what that means
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def pull_model(source: str, progress: bool = True, cache: Path | None = None, force: bool = False) -> Resolved:
    """Download (a hub id) and convert into the cache without loading. A cached hub model is converted
    again when the hub has a newer revision, a folder when its files changed, either with `force`."""
    cache = cache or cache_dir()
    p = Path(source).expanduser()
    if p.is_file():
        raise ModelNotFoundError(f"{source} is a .nanoqwen file already; nothing to pull")
    if p.is_dir():
        return _from_folder(p, cache, progress, force)
    cached = _find_cached(str(source), cache)
    meta = read_meta(cached) if cached is not None else {}
    hub_id = meta["source"] if meta.get("kind") == "hub" else str(source)  # a cache name pulls its hub id
    if not is_hub_id(hub_id):
        if cached is not None:
            raise ModelNotFoundError(f"{cached.name} did not come from the hub: nothing to pull")
        raise ModelNotFoundError(f"{source}: no such checkpoint folder or cached model, and not a hub id")
    latest, why = _latest_revision(hub_id)
    if cached is not None and meta.get("source") == hub_id and not force:
        if latest is None:
            return Resolved(cached, False, meta, f"kept the cached revision: cannot ask the hub ({why})")
        if latest == meta.get("revision"):
            return Resolved(cached, False, meta, f"up to date (revision {latest[:12]})")
    return _pull_hub(hub_id, progress, cache, latest, force)


# -- listing and removing --


def _quantization(q: dict) -> str:
    if "bits" in q and "group_size" in q:
        return f"int{q['bits']} g{q['group_size']}"
    return json.dumps(q, sort_keys=True)[:40]


def list_models(cache: Path | None = None) -> list[CachedModel]:
    """Every .nanoqwen file in the cache, by name, with what its record and header say."""
    from nanoqwen_format import NanoqwenFormatError, open_model

    cache = cache or cache_dir()
    out = []
    for path in sorted(cache.glob(f"*{SUFFIX}")) if cache.is_dir() else []:
        if path.name.startswith("."):
            continue  # a conversion in progress
        meta = read_meta(path)
        quant, error, source = None, None, meta.get("source")
        try:
            with open_model(path) as nq:
                quant = _quantization(nq.quantization)
                source = source or nq.provenance.get("source")
        except NanoqwenFormatError as e:
            error = str(e).splitlines()[0]
        out.append(CachedModel(path.stem, path, path.stat().st_size, source, meta.get("kind", "file"), quant,
                               meta.get("converted_at"), meta.get("last_used"), error))
    return out


def remove_model(name: str, cache: Path | None = None) -> CachedModel:
    """Delete a cached model (its file, record and CRC record); ModelNotFoundError when there is none."""
    from nanoqwen_format.integrity import forget

    cache = cache or cache_dir()
    path = _find_cached(name, cache)
    if path is None:
        raise ModelNotFoundError(f"no model named {name!r} in the cache ({cache}); `nanoqwen-cli models` "
                                 "lists them")
    meta = read_meta(path)
    gone = CachedModel(path.stem, path, path.stat().st_size, meta.get("source"), meta.get("kind", "file"), None,
                       meta.get("converted_at"), meta.get("last_used"))
    forget(path, verified_dir(cache))
    path.unlink()
    meta_path(path).unlink(missing_ok=True)
    return gone


# -- the Hugging Face download cache --


def download_size(download_dir) -> int:
    """Bytes a hub download occupies in the Hugging Face cache (its blobs; the snapshot links are free)."""
    root = Path(download_dir)
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())


def hf_hub_cache() -> Path:
    """Where huggingface_hub keeps downloads ($HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def drop_download(hub_id: str, cache: Path | None = None) -> int:
    """Delete every revision of hub_id from the Hugging Face cache; the bytes freed (0 when none was there).

    The converted .nanoqwen file does not need the download; pulling again downloads it again.
    """
    from huggingface_hub import scan_cache_dir

    cached = _find_cached(hub_id, cache or cache_dir())
    meta = read_meta(cached) if cached is not None else {}
    where = Path(meta["download_dir"]).parent if meta.get("download_dir") else hf_hub_cache()
    try:
        info = scan_cache_dir(where)
    except Exception:  # no cache there (already dropped, or never downloaded)
        return 0
    for repo in info.repos:
        if repo.repo_id == hub_id and repo.repo_type == "model":
            strategy = info.delete_revisions(*(r.commit_hash for r in repo.revisions))
            strategy.execute()
            return strategy.expected_freed_size
    return 0
