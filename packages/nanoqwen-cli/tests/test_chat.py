"""`nanoqwen-cli chat` driven through stdin with click's CliRunner (tiny model, CPU reference)."""

from __future__ import annotations

import re

from nanoqwen_cli import session
from nanoqwen_engine import SamplingParams

GREEDY = ["-t", "0", "-n", "6"]


def _chat(invoke, model, lines, *flags):
    return invoke(
        ["chat", "--model", model, "--device", "cpu", *GREEDY, *flags], input="".join(f"{x}\n" for x in lines)
    )


def _prompt_tokens(stderr: str) -> list[int]:
    return [int(n) for n in re.findall(r"prompt (\d+) tokens", stderr)]


def _greedy_text(engine, messages) -> str:
    return engine.complete(messages, SamplingParams(temperature=0, max_tokens=6)).text


def test_history_grows_and_reset_forgets_it(invoke, tiny_model, tiny_engine):
    result = _chat(invoke, tiny_model, ["hello", "and then?", "/reset", "hello", "/exit", "never read"])
    assert result.exit_code == 0, result.output
    first, second, third = _prompt_tokens(result.stderr)
    assert second > first, "the second turn carries the first turn's question and answer"
    assert third == first, "/reset starts the next turn from an empty history"
    a1 = _greedy_text(tiny_engine, [{"role": "user", "content": "hello"}])
    a2 = _greedy_text(
        tiny_engine,
        [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": a1},
            {"role": "user", "content": "and then?"},
        ],
    )
    assert result.stdout == f"{a1}\n{a2}\n{a1}\n"
    assert "(conversation reset)" in result.stderr


def test_eof_ends_the_session_cleanly(invoke, tiny_model):
    result = _chat(invoke, tiny_model, ["hello"])
    assert result.exit_code == 0, result.output
    assert len(_prompt_tokens(result.stderr)) == 1


def test_system_message_reaches_the_template(invoke, tiny_model, tiny_engine):
    system = "Answer in haiku."
    result = _chat(invoke, tiny_model, ["hello"], "--system", system)
    want = tiny_engine.encode_prompt(
        [{"role": "system", "content": system}, {"role": "user", "content": "hello"}]
    )
    assert _prompt_tokens(result.stderr) == [len(want)]


def test_blank_lines_and_unknown_commands_are_not_turns(invoke, tiny_model):
    result = _chat(invoke, tiny_model, ["", "/frobnicate", "   ", "hello", "/help"])
    assert result.exit_code == 0, result.output
    assert len(_prompt_tokens(result.stderr)) == 1
    assert "unknown command '/frobnicate'" in result.stderr


def test_a_failed_turn_keeps_the_session(invoke, tiny_model):
    # 40 tokens of context: the long question cannot fit, the short one after it can.
    result = _chat(invoke, tiny_model, ["word " * 60, "hi"], "--max-context", "40")
    assert result.exit_code == 0, result.output
    assert re.search(r"^error: .*prompt.*\b40\b", result.stderr, re.M), result.stderr
    assert len(_prompt_tokens(result.stderr)) == 1, "the turn after the failed one is answered"


class _InterruptFirstAnswer:
    """The real engine, except that the first answer is cut by Ctrl-C after its first event."""

    def __init__(self, engine):
        self._engine = engine
        self.interrupted = False

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, request, params=None):
        events = self._engine.generate(request, params)
        if self.interrupted:
            return events
        self.interrupted = True

        def first_then_ctrl_c():
            try:
                yield next(events)
                raise KeyboardInterrupt
            finally:
                events.close()

        return first_then_ctrl_c()


def test_ctrl_c_stops_the_answer_not_the_session(invoke, tiny_model, monkeypatch):
    wrapped = []
    real_load = session.load

    def load(*args, **kwargs):
        loaded = real_load(*args, **kwargs)
        loaded.engine = _InterruptFirstAnswer(loaded.engine)
        wrapped.append(loaded.engine)
        return loaded

    monkeypatch.setattr(session, "load", load)
    result = _chat(invoke, tiny_model, ["hello", "hello again"])
    assert result.exit_code == 0, result.output
    assert "(answer stopped)" in result.stderr
    assert len(_prompt_tokens(result.stderr)) == 1, "the turn after Ctrl-C is answered in full"
    pool = wrapped[0].backend.pool
    assert pool.n_used == 0, "the interrupted request gave its KV pages back"
