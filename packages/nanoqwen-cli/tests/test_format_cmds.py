"""`nanoqwen-cli convert` and `inspect`: nanoqwen-format's commands, mounted with the same flags."""

from __future__ import annotations

import json

import numpy as np
from nanoqwen_format import open_model
from nanoqwen_format.synthetic import tiny_config, write_hf_checkpoint


def test_convert_then_inspect_a_synthetic_checkpoint(invoke, tmp_path):
    config = tiny_config()
    hf = tmp_path / "hf"
    write_hf_checkpoint(hf, config, seed=3)
    out = tmp_path / "converted.nanoqwen"

    converted = invoke(["convert", hf, "-o", out, "--quiet"])
    assert converted.exit_code == 0, converted.output
    with open_model(out) as nq:
        assert nq.config["hidden_size"] == config["hidden_size"]
        assert nq.tensor("model.layers.0.self_attn.q_proj.qweight").dtype == np.uint32

    shown = invoke(["inspect", out, "--json"])
    assert shown.exit_code == 0, shown.output
    header = json.loads(shown.stdout)
    assert header["config"]["num_hidden_layers"] == config["num_hidden_layers"]

    again = invoke(["convert", hf, "-o", out, "--quiet"])
    assert again.exit_code != 0 and "--force" in again.output, "the format command's own checks come along"


def test_inspect_a_bad_file_is_one_error_line(invoke, tmp_path):
    bogus = tmp_path / "bogus.nanoqwen"
    bogus.write_bytes(b"NOTNANOQ" + bytes(8192))
    result = invoke(["inspect", bogus])
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert (
        result.stderr.strip().startswith(f"error: {bogus}: ") and len(result.stderr.strip().splitlines()) == 1
    )


def test_help_has_examples(invoke):
    for command in ("run", "chat", "convert", "inspect", "bench", "verify", "models", "pull", "rm"):
        result = invoke([command, "--help"])
        assert result.exit_code == 0
        assert "Example" in result.stdout and f"nanoqwen-cli {command}" in result.stdout, command


def test_inspect_prints_eps_as_written_in_the_config(invoke, tmp_path):
    from nanoqwen_format.synthetic import write_synthetic

    eps = float(np.float32(1e-6))  # 9.999999974752427e-07: what a float32 round trip leaves
    path = tmp_path / "eps.nanoqwen"
    write_synthetic(path, tiny_config(rms_norm_eps=eps, vocab_size=2048), seed=1)
    shown = invoke(["inspect", path])
    assert shown.exit_code == 0, shown.output
    assert "eps 1e-06" in shown.stdout and "9.99999" not in shown.stdout
