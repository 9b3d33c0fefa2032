"""`nanoqwen-cli chat` on a real terminal (a pty): a paste is one turn, typed lines are one turn each,
\"\"\" spans lines typed slowly, Ctrl-D leaves the shell's prompt on a fresh line.

The process runs with a pty as stdin, stdout and stderr, as in a terminal; the test types into the
master side and reads what the terminal would show (echo included).
"""

from __future__ import annotations

import os
import re
import select
import subprocess
import time

import pytest
from nanoqwen_cli.testing import argv

pytestmark = pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pty (POSIX)")

TIMEOUT = 120
STATS = re.compile(rb"prompt (\d+) tokens")


class Terminal:
    def __init__(self, args, env):
        master, slave = os.openpty()
        self.proc = subprocess.Popen(
            argv(args),
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            start_new_session=True,
        )
        os.close(slave)
        self.fd = master
        self.seen = b""

    def type(self, data: bytes) -> None:
        os.write(self.fd, data)

    def read_until(self, pattern: re.Pattern, count: int = 1) -> bytes:
        """Read the screen until `pattern` has matched `count` times in all output so far."""
        deadline = time.monotonic() + TIMEOUT
        while len(pattern.findall(self.seen)) < count:
            left = deadline - time.monotonic()
            assert left > 0, (
                f"timed out waiting for {pattern.pattern!r}; screen:\n{self.seen.decode(errors='replace')}"
            )
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.fd, 1 << 16)
                except OSError:  # EIO: the process closed the terminal
                    chunk = b""
                assert chunk, f"the terminal closed; screen:\n{self.seen.decode(errors='replace')}"
                self.seen += chunk
        return self.seen

    def finish(self) -> int:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.fd], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(self.fd, 1 << 16)
                except OSError:
                    break
                if not chunk:
                    break
                self.seen += chunk
            elif self.proc.poll() is not None:
                break
        rc = self.proc.wait(timeout=TIMEOUT)
        os.close(self.fd)
        return rc


@pytest.fixture
def term_env(tmp_path):
    e = dict(os.environ)
    e.update(
        NANOQWEN_CACHE=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", TERM="dumb"
    )
    for name in ("NANOQWEN_MODEL", "NANOQWEN_DEBUG"):
        e.pop(name, None)
    return e


def _tokens(model, messages) -> int:
    from nanoqwen_engine import Engine

    return len(Engine.load(model, device="cpu", progress=False).encode_prompt(messages))


def test_paste_is_one_turn_typed_lines_are_two_and_ctrl_d_ends_the_line(tiny_model, term_env, rng):
    lines = [
        f"def f{rng.integers(1000)}(xs):",
        f"    return sorted(xs)[:{rng.integers(1, 9)}]",
        "print(f([3, 1]))",
    ]
    t = Terminal(["chat", "--model", tiny_model, "--device", "cpu", "-t", "0", "-n", 4], term_env)
    t.read_until(re.compile(rb">>> "))
    t.type(("\n".join(lines) + "\n").encode())  # one write: what a terminal sends for a paste
    t.read_until(STATS)
    t.type(b"hello\n")
    t.read_until(STATS, 2)
    t.read_until(re.compile(rb">>> "), 3)
    t.type(b"\x04")  # Ctrl-D at an empty prompt
    rc = t.finish()
    screen = t.seen
    assert rc == 0, screen.decode(errors="replace")
    counts = [int(n) for n in STATS.findall(screen)]
    assert len(counts) == 2, (
        f"a 3-line paste and a typed line are two turns: {screen.decode(errors='replace')}"
    )
    assert counts[0] == _tokens(tiny_model, [{"role": "user", "content": "\n".join(lines)}])
    assert b"... " in screen, "the paste's later lines are shown as continuation lines"
    assert screen.endswith(b">>> \r\n"), f"Ctrl-D leaves the cursor on a new line: {screen[-40:]!r}"


def test_quoted_lines_typed_slowly_are_one_turn(tiny_model, term_env):
    t = Terminal(["chat", "--model", tiny_model, "--device", "cpu", "-t", "0", "-n", 3], term_env)
    t.read_until(re.compile(rb">>> "))
    body = ["class Stack:", "    def push(self, x):", "        self.items.append(x)"]
    t.type(b'"""\n')
    for line in body:
        time.sleep(0.3)  # slower than any paste: only the quotes hold these lines together
        t.type(line.encode() + b"\n")
    time.sleep(0.3)
    t.type(b'"""\n')
    t.read_until(STATS)
    t.type(b"/bye\n")
    assert t.finish() == 0
    counts = [int(n) for n in STATS.findall(t.seen)]
    assert counts == [_tokens(tiny_model, [{"role": "user", "content": "\n".join(body)}])]
