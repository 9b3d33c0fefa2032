"""The real Qwen2.5 tokenizer and chat template; the streaming detokenizer never splits a character."""

from __future__ import annotations

import pytest
from nanoqwen_engine import InvalidRequestError, TemplateError
from nanoqwen_engine.chat import ChatTemplate


def test_reference_tokenization(tokenizer):
    # from shared/data/README.md, as the real HF tokenizer gives it
    ids = tokenizer.encode("<|im_start|>user\ndef fib(n):\n    return n<|im_end|>")
    assert ids == [151644, 872, 198, 750, 15801, 1445, 982, 262, 470, 308, 151645]
    assert tokenizer.decode(ids) == "<|im_start|>user\ndef fib(n):\n    return n<|im_end|>"


def test_special_and_fim_markup_is_parsed(tokenizer):
    ids = tokenizer.encode("<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>")
    assert ids[0] == 151659 and 151661 in ids and ids[-1] == 151660
    literal = tokenizer.encode("<|im_start|>", parse_special=False)
    assert 151644 not in literal and tokenizer.decode(literal) == "<|im_start|>"


def test_chat_template_renders_chatml(tokenizer):
    msgs = [{"role": "user", "content": "def fib(n):"}]
    assert tokenizer.apply_chat_template(msgs) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\ndef fib(n):<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    assert tokenizer.apply_chat_template(msgs, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n"
    )
    ids = tokenizer.encode(tokenizer.apply_chat_template(msgs))
    assert ids[0] == 151644 and ids[-3:] == tokenizer.encode("<|im_start|>assistant\n")


def test_bad_messages_and_templates_are_clear_errors(tokenizer):
    with pytest.raises(InvalidRequestError, match="message 0"):
        tokenizer.apply_chat_template([{"role": "user"}])
    with pytest.raises(InvalidRequestError):
        tokenizer.apply_chat_template([])
    with pytest.raises(TemplateError, match="compile"):
        ChatTemplate("{% for %}")
    strict = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}x")
    with pytest.raises(TemplateError, match="user first"):
        strict.render([{"role": "system", "content": "s"}])
    # The sandbox refuses attribute tricks a hostile template might try.
    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TemplateError):
        evil.render([{"role": "user", "content": "x"}])


# Characters whose UTF-8 bytes the Qwen2.5 BPE splits over 2-3 tokens (checked below, not assumed).
SPLIT_CHARS = ["🧬", "龘", "𝔘", "🫠", "鬱"]


def stream_deltas(tokenizer, ids):
    dec = tokenizer.stream()
    deltas = [dec.push(i) for i in ids]
    tail = dec.flush()
    return deltas, tail


def test_stream_holds_back_split_characters(tokenizer):
    for ch in SPLIT_CHARS:
        ids = tokenizer.encode(ch)
        assert len(ids) > 1, f"{ch!r} is one token now: pick another character"
        deltas, tail = stream_deltas(tokenizer, ids)
        assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == ch and tail == ""


def test_stream_deltas_are_whole_characters_and_concatenate_to_decode(tokenizer, rng):
    pieces = ["def fib(n):\n", "    return n", " 中文字符 ", "émigré ", "🦀", "🫠🧬", "龘鬱", "\t", "<|im_end|>",
              "𝔘nicode ", "∑ℵ€ ", "ok"]
    for _ in range(20):
        text = "".join(rng.choice(pieces, size=int(rng.integers(1, 12))))
        ids = tokenizer.encode(text)
        deltas, tail = stream_deltas(tokenizer, ids)
        for d in deltas:
            assert "\ufffd" not in d
            d.encode("utf-8")  # whole characters only: would raise on a lone surrogate
        assert "".join(deltas) + tail == tokenizer.decode(ids) == text


def test_incomplete_character_at_the_end_flushes_as_replacement(tokenizer):
    ids = tokenizer.encode("🫠")
    deltas, tail = stream_deltas(tokenizer, ids[:-1])
    assert deltas == [""] * (len(ids) - 1) and tail == "\ufffd"
