"""The CRC check on a model's first load: a damaged file fails with one line, a checked one is not read
again, --no-verify skips the check."""

from __future__ import annotations

import os
import shutil

from nanoqwen_engine.model_source import verified_dir
from nanoqwen_format import open_model
from nanoqwen_format.integrity import is_verified

PROMPT = "def fib(n):"


def _run(invoke, model, *flags):
    return invoke(
        ["run", "--model", model, "--device", "cpu", "--raw", "-t", 0, "-n", 3, "--quiet", *flags, PROMPT]
    )


def _flip_random_bit(path, rng) -> str:
    """Flip one bit at a random place in a random tensor's data; the tensor's name."""
    with open_model(path) as m:
        name = m.tensor_names[int(rng.integers(len(m.tensor_names)))]
        info = m.tensor_info(name)
    offset = info["offset"] + int(rng.integers(info["nbytes"]))
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << int(rng.integers(8)))]))
    return name


def test_first_load_checks_and_remembers(invoke, tiny_model, tmp_path):
    model = tmp_path / "copy.nanoqwen"
    shutil.copyfile(tiny_model, model)
    assert not is_verified(model, verified_dir())
    assert _run(invoke, model).exit_code == 0
    assert is_verified(model, verified_dir()), "the check's result is remembered"


def test_a_flipped_bit_fails_with_one_line_and_no_verify_loads_anyway(invoke, tiny_model, tmp_path, rng):
    model = tmp_path / "damaged.nanoqwen"
    shutil.copyfile(tiny_model, model)
    tensor = _flip_random_bit(model, rng)
    result = _run(invoke, model)
    assert result.exit_code == 1, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {model}: tensor {tensor}: CRC32 mismatch"), line
    assert "--no-verify" in line
    assert _run(invoke, model, "--no-verify").exit_code == 0
    assert not is_verified(model, verified_dir())


def test_a_file_changed_after_its_check_is_checked_again(invoke, tiny_model, tmp_path, rng):
    model = tmp_path / "later.nanoqwen"
    shutil.copyfile(tiny_model, model)
    assert _run(invoke, model).exit_code == 0
    _flip_random_bit(model, rng)
    st = os.stat(model)
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert _run(invoke, model).exit_code == 1
