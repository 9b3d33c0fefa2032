"""The ladder's synthetic model files, written once per directory (atomically: a killed run leaves no
half-written file that a later run would trust)."""

from __future__ import annotations

import os
from pathlib import Path

from nanoqwen_format import tiny_config, write_synthetic
from nanoqwen_format.synthetic import qwen7b_config

# 4 layers, not 2: greedy chains then depend on attention over several layers, like a real model's do
TINY = dict(num_hidden_layers=4)
SEED_TINY, SEED_7B = 20261130, 7


def _write_once(path: Path, config: dict, seed: int) -> Path:
    if path.exists():
        return path
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    write_synthetic(tmp, config, seed=seed)
    os.replace(tmp, path)
    return path


def tiny_model(d: Path) -> Path:
    """hidden 256, intermediate 512, 4 layers, 2 heads / 1 KV head, vocab 152064 (~160 MB)."""
    return _write_once(Path(d) / "ladder_tiny.nanoqwen", tiny_config(**TINY), SEED_TINY)


def qwen7b_model(d: Path, path: str | None = None) -> Path:
    """The Qwen2.5-Coder-7B shape with random weights (~5.5 GB), at `path` if given."""
    if path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        return _write_once(p, qwen7b_config(), 0)
    return _write_once(Path(d) / "ladder_qwen7b.nanoqwen", qwen7b_config(), SEED_7B)
