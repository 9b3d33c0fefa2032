"""Stop strings over a text stream: emit text as it comes, but never past the first stop string.

The first stop string to COMPLETE ends the request (as vLLM and transformers do: generation cannot wait
to see whether a longer stop string would have matched earlier), and the text is cut where that match
starts. Text that could be the start of a stop string is held back until the next chunk decides it:

    stops ["\\n\\n"]:  "def f():\\n" -> emit "def f():", hold "\\n"
                      "    return" -> emit "\\n    return"          (no match: the hold is released)
                      "\\n\\nx"    -> emit "", stop                  (cut before "\\n\\n")
"""

from __future__ import annotations

from collections.abc import Sequence


def _holdback(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class StopStrings:
    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self._pending = ""  # held back: a possible start of a stop string
        self.stopped = False

    def push(self, text: str) -> str:
        """The text that can be emitted now; sets `stopped` when a stop string completed."""
        text = self._pending + text
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return text[: min(hits)]
        hold = _holdback(text, self.stops)
        self._pending = text[len(text) - hold :]
        return text[: len(text) - hold]

    def flush(self) -> str:
        """At the end of the request: whatever was held back (no stop string completed)."""
        out, self._pending = self._pending, ""
        return out
