"""Cut a model file into pieces that the GPU machine can take one per call, and print the commands that
rebuild it there.

The device machine cannot reach the package registry and a call carries at most 64 MiB of ignored files,
so a 1.1 GB GGUF (or a 1.6 GB .nanoqwen) goes over in pieces: this script writes piece i of FILE to
`.model/NAME/pNN/piece` (ignored by git; one folder per call, carried with the `run` tool's `carry`), and
prints, per piece, the command that checks the piece's sha256 on the device and writes it at its offset
into /tmp/nq-model/NAME (with dd seek, so a repeated or out-of-order call does no harm), then the command
that checks the whole file's size and sha256 there. /tmp/nq-model lasts while the machine stays warm.

    python scripts/device_model_pieces.py [FILE] [--piece-mib 54] [--out .model]

FILE defaults to the real Qwen2.5-Coder-1.5B-Instruct GGUF (fetched and cached by tests/ladder/real_model.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEVICE_DIR = "/tmp/nq-model"
MIB = 1 << 20


def split(path: Path, out: Path, piece_bytes: int) -> dict:
    """Write the pieces (unless a manifest for this file and piece size exists); returns the manifest."""
    folder = out / path.name
    manifest_path = folder / "manifest.json"
    st = path.stat()
    if manifest_path.exists():
        m = json.loads(manifest_path.read_text())
        if (m["size"], m["mtime_ns"], m["piece_bytes"]) == (st.st_size, st.st_mtime_ns, piece_bytes) and \
                all((folder / p["dir"] / "piece").is_file() for p in m["pieces"]):
            return m
    folder.mkdir(parents=True, exist_ok=True)
    whole = hashlib.sha256()
    pieces = []
    with open(path, "rb") as f:
        while block := f.read(piece_bytes):
            i = len(pieces)
            d = folder / f"p{i:02d}"
            d.mkdir(exist_ok=True)
            (d / "piece").write_bytes(block)
            whole.update(block)
            pieces.append({"dir": d.name, "offset": i * piece_bytes, "bytes": len(block),
                           "sha256": hashlib.sha256(block).hexdigest()})
    m = {"name": path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": whole.hexdigest(),
         "piece_bytes": piece_bytes, "pieces": pieces}
    manifest_path.write_text(json.dumps(m, indent=1))
    return m


def commands(m: dict, out_rel: str) -> list[tuple[str, str]]:
    """(carry path, device command) per piece, then ("", the final check)."""
    target = f"{DEVICE_DIR}/{m['name']}"
    cmds = []
    for p in m["pieces"]:
        rel = f"{out_rel}/{m['name']}/{p['dir']}"
        cmds.append((rel, f"mkdir -p {DEVICE_DIR} && echo '{p['sha256']}  {rel}/piece' | sha256sum -c --quiet && "
                          f"dd if={rel}/piece of={target} bs=1M seek={p['offset'] // MIB} conv=notrunc "
                          f"status=none && ls -l {target}"))
    cmds.append(("", f"test $(stat -c %s {target}) -eq {m['size']} && "
                     f"echo '{m['sha256']}  {target}' | sha256sum -c -"))
    return cmds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", type=Path, nargs="?", default=None)
    ap.add_argument("--piece-mib", type=int, default=54, help="piece size in MiB (default 54: a call carries 64 MiB with the working tree counted in; 63 was refused)")
    ap.add_argument("--out", type=Path, default=REPO / ".model", help="where the pieces go (git-ignored)")
    args = ap.parse_args()
    if not 1 <= args.piece_mib <= 63:
        ap.error("--piece-mib must be 1..63 (a device call carries at most 64 MiB)")
    path = args.file
    if path is None:
        sys.path.insert(0, str(REPO / "tests"))
        from ladder.real_model import fetch

        path = fetch()
    m = split(path.resolve(), args.out.resolve(), args.piece_mib * MIB)
    try:
        out_rel = args.out.resolve().relative_to(REPO).as_posix()
    except ValueError:
        print(f"error: --out {args.out} is outside the repository; the device gets only the checkout",
              file=sys.stderr)
        return 1
    print(f"# {m['name']}: {m['size']} bytes, sha256 {m['sha256']}, {len(m['pieces'])} pieces of "
          f"<= {args.piece_mib} MiB under {out_rel}/{m['name']}/")
    print("# one device call per piece (run tool: carry=[PATH], command=CMD), in any order; then the check.")
    for carry, cmd in commands(m, out_rel):
        print(f"\n# carry: {carry}" if carry else "\n# check (no carry):")
        print(cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
