"""`nanoqwen-cli chat` driven through stdin with click's CliRunner (tiny model, CPU reference).

A pipe gives one turn per line (and \"\"\" blocks); the terminal's paste handling is tested on a real
pty in test_chat_pty.py.
"""

from __future__ import annotations

import json
import re

from nanoqwen_cli import session
from nanoqwen_engine import SamplingParams

GREEDY = ["-t", "0", "-n", "6"]


def _chat(invoke, model, lines, *flags, sampling=GREEDY):
    return invoke(
        ["chat", "--model", model, "--device", "cpu", *sampling, *flags],
        input="".join(f"{x}\n" for x in lines),
    )


def _prompt_tokens(stderr: str) -> list[int]:
    return [int(n) for n in re.findall(r"prompt (\d+) tokens", stderr)]


def _greedy_text(engine, messages, n=6) -> str:
    return engine.complete(messages, SamplingParams(temperature=0, max_tokens=n)).text


def _user(text):
    return {"role": "user", "content": text}


def test_history_grows_and_clear_forgets_it(invoke, tiny_model, tiny_engine):
    result = _chat(invoke, tiny_model, ["hello", "and then?", "/clear", "hello", "/bye", "never read"])
    assert result.exit_code == 0, result.output
    first, second, third = _prompt_tokens(result.stderr)
    assert second > first, "the second turn carries the first turn's question and answer"
    assert third == first, "/clear starts the next turn from an empty history"
    a1 = _greedy_text(tiny_engine, [_user("hello")])
    a2 = _greedy_text(tiny_engine, [_user("hello"), {"role": "assistant", "content": a1}, _user("and then?")])
    assert result.stdout == f"{a1}\n{a2}\n{a1}\n"
    assert "(conversation cleared)" in result.stderr
    assert "load" not in result.stderr.split("\n", 1)[1], "the load time is in the banner only, not per turn"


def test_reset_and_exit_still_work(invoke, tiny_model):
    result = _chat(invoke, tiny_model, ["hello", "/reset", "hello", "/exit", "never read"])
    assert result.exit_code == 0, result.output
    first, second = _prompt_tokens(result.stderr)
    assert first == second


def test_eof_ends_the_session_cleanly(invoke, tiny_model):
    result = _chat(invoke, tiny_model, ["hello"])
    assert result.exit_code == 0, result.output
    assert len(_prompt_tokens(result.stderr)) == 1


def test_system_message_from_the_flag_and_from_set(invoke, tiny_model, tiny_engine):
    system, other = "Answer in haiku.", "You are a terse reviewer."
    result = _chat(
        invoke,
        tiny_model,
        ["hello", f"/set system {other}", "hello", "/set system", "hello"],
        "--system",
        system,
    )
    assert result.exit_code == 0, result.output
    with_flag, with_set, default = _prompt_tokens(result.stderr)
    assert with_flag == len(
        tiny_engine.encode_prompt([{"role": "system", "content": system}, _user("hello")])
    )
    a1 = _greedy_text(tiny_engine, [{"role": "system", "content": system}, _user("hello")])
    want = [
        {"role": "system", "content": other},
        _user("hello"),
        {"role": "assistant", "content": a1},
        _user("hello"),
    ]
    assert with_set == len(tiny_engine.encode_prompt(want))
    a2 = _greedy_text(tiny_engine, want)
    history = [*want[1:], {"role": "assistant", "content": a2}, _user("hello")]
    assert default == len(tiny_engine.encode_prompt(history)), "/set system alone: the template's default"


def test_quoted_block_is_one_turn(invoke, tiny_model, tiny_engine, rng):
    body = [f"def f{rng.integers(100)}(x):", f"    return x * {rng.integers(1, 9)}", "", "print(f(2))"]
    result = _chat(invoke, tiny_model, ['"""', *body, '"""', "/clear", '"""one line"""'])
    assert result.exit_code == 0, result.output
    block, line = _prompt_tokens(result.stderr)
    assert block == len(tiny_engine.encode_prompt([_user("\n".join(body))]))
    assert line == len(tiny_engine.encode_prompt([_user("one line")]))


def test_set_temperature_zero_is_greedy(invoke, tiny_model, tiny_engine):
    result = _chat(invoke, tiny_model, ["/set temperature 0", "/set max_tokens 5", "hello"], sampling=[])
    assert result.exit_code == 0, result.output
    assert result.stdout == _greedy_text(tiny_engine, [_user("hello")], n=5) + "\n"
    assert "(temperature = 0.0)" in result.stderr and "(max_tokens = 5)" in result.stderr


def test_set_refuses_bad_values_and_keeps_the_session(invoke, tiny_model):
    lines = ["/set temperature nan", "/set top-p 2", "/set seed -2", "/set frobnicate 1", "/set", "hello"]
    result = _chat(invoke, tiny_model, lines)
    assert result.exit_code == 0, result.output
    errors = [x for x in result.stderr.splitlines() if x.startswith("error: ")]
    assert len(errors) == 4, result.stderr
    assert "'--temperature'" in errors[0] and "finite" in errors[0] and "x>=0" in errors[0]
    assert "'--top-p'" in errors[1] and "0<x<=1" in errors[1]
    assert "'--seed'" in errors[2] and "-1" in errors[2]
    assert "frobnicate" in errors[3] and "temperature" in errors[3]
    assert "settings: temperature = 0.0, max_tokens = 6" in result.stderr
    assert len(_prompt_tokens(result.stderr)) == 1


def test_seeds_replay_and_a_random_seed_is_reported(invoke, tiny_model, rng):
    seed = int(rng.integers(1 << 31))
    sampling = ["-t", "1.0", "--top-k", "40", "-n", "8"]
    lines = [f"/set seed {seed}", "hello", "/clear", "hello", "/set seed -1", "/clear", "hello"]
    result = _chat(invoke, tiny_model, lines, sampling=sampling)
    assert result.exit_code == 0, result.output
    out = result.stdout  # a + b + c, each ending in a newline; a sampled answer may hold newlines too
    assert any(out.startswith(f"{out[:i]}\n{out[:i]}\n") for i, ch in enumerate(out) if ch == "\n"), (
        "the same seed gives the same sampled answer"
    )
    reported = [int(s) for s in re.findall(r"\| seed (\d+)", result.stderr)]
    assert reported[:2] == [seed, seed] and len(reported) == 3


def test_save_then_load_continues_the_conversation(invoke, tiny_model, tiny_engine, tmp_path):
    saved = tmp_path / "chat.json"
    first = _chat(
        invoke,
        tiny_model,
        ["hello", "/set system Be brief.", "/set top_k 7", f"/save {saved}"],
        "--stop",
        "@@",
    )
    assert first.exit_code == 0, first.output
    data = json.loads(saved.read_text())
    assert data["format"] == "nanoqwen-chat" and data["system"] == "Be brief."
    assert data["settings"] == {"temperature": 0.0, "max_tokens": 6, "stop": ["@@"], "top_k": 7}
    a1 = _greedy_text(tiny_engine, [_user("hello")])
    assert data["messages"] == [_user("hello"), {"role": "assistant", "content": a1}]

    second = _chat(invoke, tiny_model, [f"/load {saved}", "and then?"], sampling=[])
    assert second.exit_code == 0, second.output
    want = [{"role": "system", "content": "Be brief."}, *data["messages"], _user("and then?")]
    assert _prompt_tokens(second.stderr) == [len(tiny_engine.encode_prompt(want))]
    assert second.stdout == _greedy_text(tiny_engine, want) + "\n", (
        "the loaded settings (greedy, 6 tokens) apply"
    )


def test_load_of_a_bad_file_is_one_error_and_the_session_goes_on(invoke, tiny_model, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "nanoqwen-chat", "version": 1, "messages": [{"role": "robot", "content": 1}]}')
    result = _chat(
        invoke, tiny_model, [f"/load {bad}", f"/load {tmp_path / 'missing.json'}", "/save", "hello"]
    )
    assert result.exit_code == 0, result.output
    errors = [x for x in result.stderr.splitlines() if x.startswith("error: ")]
    assert len(errors) == 3, result.stderr
    assert str(bad) in errors[0] and "message 0" in errors[0]
    assert "missing.json" in errors[1] and "/save needs a file name" in errors[2]
    assert len(_prompt_tokens(result.stderr)) == 1


def test_history_beyond_the_context_drops_the_oldest_turns(invoke, tiny_model, tiny_engine):
    # A context of 96 tokens keeps 96 - min(6, 96 // 4) = 90 for the prompt; each turn adds ~20 tokens.
    lines = [f"question number {i} about sorting lists" for i in range(8)]
    result = _chat(invoke, tiny_model, lines, "--max-context", "96")
    assert result.exit_code == 0, result.output
    counts = _prompt_tokens(result.stderr)
    assert len(counts) == 8, "every turn is answered"
    assert max(counts) <= 90
    dropped = re.findall(r"dropped the (\d+) oldest turns? to fit the context of 96 tokens", result.stderr)
    assert dropped, result.stderr
    assert counts[-1] > counts[0], "the history was trimmed, not restarted"


def test_a_message_longer_than_the_context_keeps_the_session(invoke, tiny_model):
    result = _chat(invoke, tiny_model, ["hello", "word " * 60, "hi"], "--max-context", "64")
    assert result.exit_code == 0, result.output
    assert re.search(r"^error: the prompt is \d+ tokens .*context holds 64", result.stderr, re.M), (
        result.stderr
    )
    assert "(the conversation is unchanged)" in result.stderr
    first, third = _prompt_tokens(result.stderr)
    assert third > first, "the turn after the refused one still has the first turn in its history"


def test_max_tokens_beyond_the_context_is_capped_once(invoke, tiny_model):
    result = _chat(
        invoke, tiny_model, ["hello", "hi"], "--max-context", "48", sampling=["-t", "0", "-n", "1000"]
    )
    assert result.exit_code == 0, result.output
    assert len(re.findall(r"note: --max-tokens 1000 capped at \d+", result.stderr)) == 1


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
    assert wrapped[0].stats()["kv_pages_used"] == 0, "the interrupted request gave its KV pages back"


def test_help_lists_the_commands(invoke, tiny_model):
    result = _chat(invoke, tiny_model, ["/help"], "--quiet")
    assert result.exit_code == 0, result.output
    for word in ("/set temperature 0", "/set system", "/clear", "/save", "/load", "/bye", '"""'):
        assert word in result.stderr, word
