"""The "processing prompt" line: shown on a terminal after a moment, erased before the answer."""

from __future__ import annotations

import io
import re
import threading

import pytest
from nanoqwen_cli import progress


class FakeTerminal(io.StringIO):
    def __init__(self):
        super().__init__()
        self.written = threading.Event()

    def isatty(self):
        return True

    def write(self, s):
        n = super().write(s)
        self.written.set()
        return n


def test_line_appears_while_waiting_and_is_erased():
    term = FakeTerminal()
    with progress.PromptProgress(1234, stream=term, delay_s=0):
        assert term.written.wait(10), "the line is shown while the body runs"
    text = term.getvalue()
    assert "processing prompt (1234 tokens)..." in text
    assert text.endswith(progress.CLEAR), "erased when the first token arrives"


def test_a_quick_prompt_shows_nothing():
    term = FakeTerminal()
    with progress.PromptProgress(10, stream=term, delay_s=60):
        pass
    assert term.getvalue() == ""


@pytest.mark.parametrize("stream", [io.StringIO(), None])
def test_nothing_outside_a_terminal(stream, capsys):
    with progress.PromptProgress(10, stream=stream, delay_s=0) as p:
        assert not p.enabled
    assert capsys.readouterr().err == ""


def test_run_shows_it_on_a_terminal_and_keeps_stdout_clean(invoke, tiny_model, monkeypatch):
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "is_terminal", lambda stream: True)
    args = ["run", "--model", tiny_model, "--device", "cpu", "--raw", "-t", 0, "-n", 3]
    shown = invoke([*args, "def f():"])
    assert shown.exit_code == 0, shown.output
    (n,) = re.findall(r"\| prompt (\d+) tokens", shown.stderr)
    assert f"processing prompt ({n} tokens)" in shown.stderr and progress.CLEAR in shown.stderr
    assert "processing" not in shown.stdout
    quiet = invoke([*args, "--quiet", "def f():"])
    assert quiet.stderr == "" and quiet.stdout == shown.stdout
