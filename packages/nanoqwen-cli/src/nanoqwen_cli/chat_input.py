"""Reading chat turns from stdin.

- In a pipe, each line is one turn (`printf 'hi\\n/bye\\n' | nanoqwen-cli chat` answers "hi").
- On a terminal, lines that arrive together are one turn: a pasted function is one message, not one
  per line. A person presses Enter, reads, and types the next line; a paste delivers its lines in one
  burst. After each line the reader waits PASTE_WINDOW_S for more input; whatever line is already
  there, or arrives within the window, belongs to the same turn. (Terminals with bracketed paste hand
  readline the whole paste as one line with newlines in it, which is one turn as well.)
- Anywhere, `\"\"\"` opens a multi-line message that runs to the next line ending in `\"\"\"` (ollama's
  syntax), for typing code by hand.

Line editing and history come from `readline` when Python has it: it reads the terminal one byte at a
time, so the lines of a paste that it has not consumed yet are still in the kernel's queue for select().
"""

from __future__ import annotations

import select
import sys

PASTE_WINDOW_S = 0.05  # a paste's lines come within milliseconds; a person's Enter and next line do not
QUOTE = '"""'
PROMPT = ">>> "
CONTINUE = "... "


class TurnReader:
    """read() -> the next turn's text, or None at end of input (Ctrl-D). Ctrl-C propagates."""

    def __init__(self, stdin=None, out=None, interactive: bool | None = None):
        self.stdin = stdin if stdin is not None else sys.stdin
        self.out = out if out is not None else sys.stdout
        self.interactive = self.stdin.isatty() if interactive is None else interactive
        if self.interactive:
            try:
                import readline  # noqa: F401  (importing it is what gives input() editing and history)
            except ImportError:
                pass

    def _line(self, prompt: str) -> str | None:
        """One line without its newline; None at end of input."""
        if self.interactive:
            try:
                return input(prompt)
            except EOFError:
                return None
        line = self.stdin.readline()
        return None if not line else line.rstrip("\r\n")

    def _pending(self) -> bool:
        """True when more input is waiting, or arrives within PASTE_WINDOW_S (the rest of a paste)."""
        try:
            ready, _, _ = select.select([self.stdin], [], [], PASTE_WINDOW_S)
        except (OSError, ValueError):  # no file descriptor behind stdin
            return False
        return bool(ready)

    def read(self) -> str | None:
        line = self._line(PROMPT)
        if line is None:
            return None
        if line.lstrip().startswith(QUOTE):
            return self._quoted(line.lstrip()[len(QUOTE) :])
        lines = [line]
        while self.interactive and self._pending():
            more = self._line(CONTINUE)
            if more is None:
                break
            lines.append(more)
        return "\n".join(lines)

    def _quoted(self, first: str) -> str:
        """The text up to the closing quotes; at end of input, what came before it."""
        lines = []
        line: str | None = first
        while line is not None:
            if line.rstrip().endswith(QUOTE):
                lines.append(line.rstrip()[: -len(QUOTE)])
                break
            lines.append(line)
            line = self._line(CONTINUE)
        # The lines that hold only the quotes are not part of the message.
        while lines and not lines[0].strip():
            lines.pop(0)
        while lines and not lines[-1].strip():
            lines.pop()
        return "\n".join(lines)
