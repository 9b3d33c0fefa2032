"""A "processing prompt" line on stderr while the engine prefills, when that takes more than a moment.

On a CPU the 1.5B model prefills a few tokens per second on 2 cores, so a long prompt keeps the
terminal silent for a minute before the first token. After DELAY_S without a token, a line
`processing prompt (N tokens)... 3s` appears on stderr and counts up; it is erased (carriage return +
clear-to-end-of-line) the moment the first token arrives, so the answer on stdout starts on a clean line.

Only on a terminal: in a pipe or a log the line would be noise (the timing line at the end reports the
prefill), and a carriage return has no meaning there.
"""

from __future__ import annotations

import sys
import threading
import time

DELAY_S = 0.5  # below this the wait reads as instant; above it, silence reads as a hang
TICK_S = 0.25
SPINNER = "|/-\\"
CLEAR = "\r\033[K"


def is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class PromptProgress:
    """`with PromptProgress(n_tokens): first = next(events)`: shows the line only while the body runs
    longer than DELAY_S, and only when enabled and stderr is a terminal."""

    def __init__(
        self, n_tokens: int | None, *, enabled: bool = True, stream=None, delay_s: float | None = None
    ):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and is_terminal(self.stream)
        self.n_tokens = n_tokens
        self.delay_s = DELAY_S if delay_s is None else delay_s
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the line is written and erased under it: never half of each
        self._shown = False
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PromptProgress:
        if self.enabled:
            self._t0 = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="nanoqwen-progress", daemon=True)
            self._thread.start()
        return self

    def _line(self, i: int) -> str:
        what = f"processing prompt ({self.n_tokens} tokens)" if self.n_tokens else "processing prompt"
        return f"{CLEAR}{what}... {time.monotonic() - self._t0:.0f}s {SPINNER[i % len(SPINNER)]}"

    def _run(self) -> None:
        if self._stop.wait(self.delay_s):
            return
        i = 0
        while True:
            with self._lock:
                if self._stop.is_set():
                    return
                self.stream.write(self._line(i))
                self.stream.flush()
                self._shown = True
            i += 1
            if self._stop.wait(TICK_S):
                return

    def __exit__(self, *exc) -> None:
        if self._thread is None:
            return
        with self._lock:
            self._stop.set()
            if self._shown:
                self.stream.write(CLEAR)
                self.stream.flush()
        self._thread.join()
