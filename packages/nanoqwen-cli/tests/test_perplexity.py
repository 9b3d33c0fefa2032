"""`nanoqwen-cli perplexity` through click's CliRunner on the tiny model with the CPU reference backend."""

from __future__ import annotations

import json

import pytest

CODE = ("import os\n\n\ndef walk(top):\n    for root, dirs, files in os.walk(top):\n        for name in files:\n"
        "            yield os.path.join(root, name)\n\n\nif __name__ == '__main__':\n"
        "    for path in walk('.'):\n        print(path)\n")


@pytest.fixture
def files(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text(CODE, encoding="utf-8")
    b.write_text(CODE.replace("walk", "scan") + "# <|im_start|> is text here\n", encoding="utf-8")
    return a, b


def test_json_matches_the_engine(invoke, tiny_model, tiny_engine, files):
    from nanoqwen_engine.perplexity import perplexity

    result = invoke(["perplexity", "--model", tiny_model, "--device", "cpu", "--window", 24, "--json", *files])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, "--json prints exactly one record"
    rec = json.loads(lines[0])
    ids = []
    for f in files:  # each file tokenized alone, special-token markup as plain text, joined in order
        ids += tiny_engine.tokenizer.encode(f.read_text(encoding="utf-8"), parse_special=False)
    assert "<|im_start|>" in files[1].read_text() and 151644 not in ids
    want = perplexity(tiny_engine, ids, window=24)
    assert rec["tokens"] == len(ids)
    assert rec["windows"] == want.windows > 2 and rec["tokens_scored"] == want.tokens_scored
    assert rec["ppl"] == pytest.approx(want.ppl, rel=1e-9)
    assert rec["nll_mean"] == pytest.approx(want.nll_mean, rel=1e-9)
    assert rec["window_nll"] == pytest.approx(want.window_nll, rel=1e-9)
    assert rec["time_s"] > 0 and rec["device"] == "cpu" and rec["files"] == [str(f) for f in files]


def test_text_output_and_progress_bar(invoke, tiny_model, files):
    result = invoke(["perplexity", "--model", tiny_model, "--device", "cpu", "--window", 16, "--max-windows", 2,
                     files[0]])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("perplexity ") and "30 tokens scored in 2 window(s) of 16" in result.stdout
    assert "scoring" in result.stderr  # the bar goes to stderr, stdout stays the one result line
    quiet = invoke(["perplexity", "--model", tiny_model, "--device", "cpu", "--window", 16, "--max-windows", 2,
                    "--quiet", files[0]])
    assert quiet.stderr == "" and quiet.stdout.split("|")[0] == result.stdout.split("|")[0]


@pytest.mark.parametrize("case", ["missing", "directory", "empty", "one-token", "window-1", "window-too-long",
                                  "not-utf8"])
def test_errors_are_one_line(invoke, tiny_model, tmp_path, files, case):
    args = ["perplexity", "--model", tiny_model, "--device", "cpu", "--quiet"]
    bad = tmp_path / "bad.txt"
    match = {
        "missing": ("file not found", [tmp_path / "nope.py"]),
        "directory": ("is a directory", [tmp_path]),
        "empty": ("the file is empty", [bad]),
        "one-token": ("needs at least 2", [bad]),
        "window-1": ("--window must be at least 2", ["--window", 1, files[0]]),
        "window-too-long": ("exceeds the context of 16", ["--max-context", 16, "--window", 32, files[0]]),
        "not-utf8": ("not UTF-8", [bad]),
    }[case]
    bad.write_bytes({"empty": b" \n", "one-token": b"a", "not-utf8": b"\xff\xfe x"}.get(case, b""))
    result = invoke([*args, *match[1]])
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert match[0] in result.stderr
