"""nanoqwen-cli as a real subprocess (`python -m nanoqwen_cli`), for the CLI's tests and the repository's
subprocess tests: the one place that spells the command line. The callers pass the environment (their
`env` fixtures give an empty model cache and an offline, empty Hugging Face home)."""

from __future__ import annotations

import signal
import subprocess
import sys

TIMEOUT = 180  # s: one CLI call on the CPU reference, model load included, takes seconds


def argv(args) -> list[str]:
    return [sys.executable, "-m", "nanoqwen_cli", *map(str, args)]


def cli(args, env, input=None, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """Run to the end; stdout and stderr captured as text."""
    return subprocess.run(argv(args), input=input, env=env, capture_output=True, text=True, timeout=timeout)


def _default_sigint() -> None:
    # A process started in the background by a non-interactive shell (`cmd &`, nohup, some CI runners)
    # inherits SIGINT as ignored, and Python then installs no KeyboardInterrupt handler: a test that sends
    # the CLI a Ctrl-C would see it ignored. The child starts with the default disposition instead.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def popen(args, env, stdin=subprocess.DEVNULL) -> subprocess.Popen:
    """Started, not waited for; stdout and stderr are binary pipes (the caller reads them as they come).
    SIGINT has its default disposition in the child whatever the test runner's (see _default_sigint)."""
    return subprocess.Popen(argv(args), stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            preexec_fn=_default_sigint)
