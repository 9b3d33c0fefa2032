"""nanoqwen-convert end to end: click's CliRunner for the commands, and a real subprocess for the exit
status and the one-line error on stderr."""

import json
import subprocess
import sys

from click.testing import CliRunner
from nanoqwen_format.cli import convert_command, inspect_command, main


def test_convert_then_inspect(hf_untied, tmp_path):
    out = tmp_path / "m.nanoqwen"
    r = CliRunner().invoke(main, [str(hf_untied), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert out.exists() and "wrote" in r.output
    assert "down_proj" in r.output  # the quantization error table (stderr is mixed in by CliRunner)
    r = CliRunner().invoke(main, ["inspect", str(out), "--verify"])
    assert r.exit_code == 0, r.output
    assert "valid, CRCs verified" in r.output and "2 layers, hidden 256" in r.output
    r = CliRunner().invoke(main, ["inspect", str(out), "--json"])
    head = json.loads(r.output)
    assert head["config"]["hidden_size"] == 256 and "tokenizer_json" not in head
    assert head["tokenizer_json_chars"] > 1_000_000 and len(head["tensors"]) == 3 + 2 * 19  # embed, norm, lm_head; per layer 2 norms, 7 x 2 INT4, 3 biases


def test_quantizer_option(hf_untied, tmp_path):
    out = tmp_path / "m.nanoqwen"
    r = CliRunner().invoke(main, [str(hf_untied), "-o", str(out), "--quiet", "--quantizer", "rtn"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["inspect", str(out), "--json"])
    assert json.loads(r.output)["provenance"]["quantizer"] == "rtn"
    r = CliRunner().invoke(main, [str(hf_untied), "-o", str(tmp_path / "n.nanoqwen"), "--quantizer", "awq"])
    assert r.exit_code == 2 and "awq" in r.output and not (tmp_path / "n.nanoqwen").exists()


def test_commands_are_reusable(hf_tied_sharded, tmp_path):
    out = tmp_path / "m.nanoqwen"
    assert CliRunner().invoke(convert_command, [str(hf_tied_sharded), "-o", str(out), "--quiet"]).exit_code == 0
    r = CliRunner().invoke(inspect_command, [str(out)])
    assert r.exit_code == 0 and "tied true" in r.output


def test_errors_are_one_line(hf_untied, tmp_path):
    bad = tmp_path / "bad.nanoqwen"
    bad.write_bytes(b"GGUF" + bytes(100))
    r = CliRunner().invoke(main, ["inspect", str(bad)])
    assert r.exit_code == 1 and r.output.strip().count("\n") == 0 and "bad magic" in r.output
    out = tmp_path / "exists.nanoqwen"
    out.write_bytes(b"x")
    r = CliRunner().invoke(main, [str(hf_untied), "-o", str(out)])
    assert r.exit_code == 1 and "--force" in r.output and out.read_bytes() == b"x"
    r = CliRunner().invoke(main, [str(tmp_path / "missing"), "-o", str(tmp_path / "m.nanoqwen")])
    assert r.exit_code == 1 and "no such folder" in r.output


def test_subprocess(hf_untied, tmp_path):
    out = tmp_path / "m.nanoqwen"
    cmd = [sys.executable, "-m", "nanoqwen_format"]
    p = subprocess.run([*cmd, str(hf_untied), "-o", str(out), "--quiet"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    p = subprocess.run([*cmd, "inspect", str(out)], capture_output=True, text=True)
    assert p.returncode == 0 and "valid" in p.stdout
    raw = bytearray(out.read_bytes())
    raw[8] = 9  # version 9
    out.write_bytes(bytes(raw))
    p = subprocess.run([*cmd, "inspect", str(out)], capture_output=True, text=True)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip() == f"error: {out}: unknown format version 9 (this reader knows 1)"
