"""StopStrings against a definition over the whole text: random texts, chunkings and stop strings."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from nanoqwen_engine.stops import StopStrings

ALPHABET = "ab\n中😀"  # few letters, so stop strings actually occur; multi-byte ones too


def expected(chunks: list[str], stops: list[str]) -> tuple[str, bool]:
    """The first chunk boundary at which any stop string occurs in the text so far ends the stream; the
    text is cut at the earliest start of a stop string there."""
    text = ""
    for c in chunks:
        text += c
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return text[: min(hits)], True
    return text, False


@settings(max_examples=400, deadline=None)
@given(chunks=st.lists(st.text(ALPHABET, max_size=4), max_size=12),
       stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3))
def test_stream_equals_cut_of_whole_text(chunks, stops):
    m = StopStrings(stops)
    out = ""
    for c in chunks:
        out += m.push(c)
        if m.stopped:
            break
    if not m.stopped:
        out += m.flush()
    want, stopped = expected(chunks, stops)
    assert (out, m.stopped) == (want, stopped)


def test_holds_back_only_possible_starts():
    m = StopStrings(["\n\n"])
    assert m.push("def f():\n") == "def f():"
    assert m.push("    return") == "\n    return"
    assert m.push("\n\nx") == "" and m.stopped


def test_no_stops_passes_everything():
    m = StopStrings([])
    assert m.push("abc") == "abc" and m.flush() == "" and not m.stopped
