"""Tokenizer: the model's own tokenizer.json (library `tokenizers`), plus a streaming detokenizer.

Special tokens written in text (`<|im_start|>`, `<|fim_prefix|>`, ...) are parsed into their ids, as the
HF tokenizer does with split_special_tokens=False, so raw prompts can carry ChatML or FIM markup.

Streaming: a byte-level BPE token is a run of BYTES, and a multi-byte UTF-8 character (an emoji, most CJK)
is often split across two or three tokens. `StreamDecoder` maps each id to its bytes and feeds them through
an incremental UTF-8 decoder, which holds back an incomplete character until its last byte arrives, so every
text delta is whole characters and the deltas concatenate to exactly `decode(all ids)`.
"""

from __future__ import annotations

import codecs
import json
import threading
from collections.abc import Iterable, Sequence
from functools import lru_cache

from tokenizers import Tokenizer as _HFTokenizer

from .chat import ChatTemplate
from .errors import ModelFormatError


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode table inverted: printable stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class Tokenizer:
    """encode/decode with the model's tokenizer.json; `chat` (a ChatTemplate) renders message lists."""

    def __init__(self, tokenizer_json: str, tokenizer_config: dict | None = None):
        try:
            self._tok = _HFTokenizer.from_str(tokenizer_json)
        except Exception as e:  # tokenizers raises its own Exception type with a long message
            raise ModelFormatError(f"embedded tokenizer.json does not load: {str(e).splitlines()[0]}") from e
        spec = json.loads(tokenizer_json)
        self._byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
        self._added = {t["id"]: t["content"] for t in spec.get("added_tokens", [])}
        self.special_ids = frozenset(t["id"] for t in spec.get("added_tokens", []) if t.get("special"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._bytes_cache: dict[int, bytes] = {}
        self._encode_lock = threading.Lock()
        self.chat = ChatTemplate.from_tokenizer_config(tokenizer_config or {})

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        """Token ids of text; no BOS is added (Qwen2 uses none).

        parse_special=False encodes special tokens' markup (`<|im_start|>`, `<|endoftext|>`) as plain text;
        added tokens that are not special (`<|fim_prefix|>`, `<tool_call>`) are matched either way, as the
        tokenizers library does.
        """
        # encode_special_tokens is a flag on the shared tokenizer object: the lock keeps one thread's
        # setting from leaking into another's encode (Engine.submit encodes on the caller's thread).
        with self._encode_lock:
            self._tok.encode_special_tokens = not parse_special
            return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        return self.chat.render(messages, add_generation_prompt=add_generation_prompt)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token_id stands for (b'' for an id the tokenizer does not know, e.g. vocab padding)."""
        b = self._bytes_cache.get(token_id)
        if b is not None:
            return b
        if token_id in self._added:
            b = self._added[token_id].encode("utf-8")
        elif self._byte_level:
            piece = self._tok.id_to_token(token_id)
            table = _byte_decoder()
            b = b"" if piece is None else bytes(table[c] for c in piece)
        else:
            b = self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")
        self._bytes_cache[token_id] = b
        return b

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Turns ids, one at a time, into text deltas that never split a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        # errors="replace": invalid byte runs (a model can emit any id) become U+FFFD, as decode() does.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by this token ('' while a character is still incomplete)."""
        return self._utf8.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is held back at the end (an incomplete character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)
