"""scripts/*.py as modules for the tests that check them on the CPU (a script is not a package: it is loaded by path)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@functools.cache
def load_script(name: str):
    """scripts/<name>.py, executed once as the module `name`."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
