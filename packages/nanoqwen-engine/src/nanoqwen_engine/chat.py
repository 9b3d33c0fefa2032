"""The chat template: the model's own Jinja template (tokenizer_config["chat_template"]) in a sandbox.

Rendered as transformers renders it: a sandboxed Jinja environment with trim_blocks and lstrip_blocks,
`messages` and `add_generation_prompt` in scope (plus the special-token strings of tokenizer_config),
and `raise_exception` for templates that validate their input. The result is text with special-token
markup, which the tokenizer parses into ids.
"""

from __future__ import annotations

from collections.abc import Sequence

from jinja2 import TemplateError as _JinjaTemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import InvalidRequestError, ModelFormatError, TemplateError

# Used when a checkpoint ships no template (base models): plain ChatML, which every Qwen2.5 model reads.
CHATML_FALLBACK = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _raise(msg: str):
    raise TemplateError(f"chat template: {msg}")


class ChatTemplate:
    def __init__(self, source: str, special: dict[str, str] | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(source)
        except _JinjaTemplateError as e:
            raise TemplateError(f"chat template does not compile: {e}") from e
        self.source = source
        self._special = special or {}

    @classmethod
    def from_tokenizer_config(cls, tokenizer_config: dict) -> ChatTemplate:
        if not isinstance(tokenizer_config, dict):
            raise ModelFormatError(f"tokenizer_config must be a JSON object, got {type(tokenizer_config).__name__}")
        src = tokenizer_config.get("chat_template") or CHATML_FALLBACK
        if isinstance(src, list):  # newer configs: [{"name": "default", "template": ...}, ...]
            if not all(isinstance(t, dict) for t in src):
                raise ModelFormatError("tokenizer_config.chat_template: a list must hold {name, template} objects")
            named = {t.get("name"): t.get("template") for t in src}
            src = named.get("default") or next(iter(named.values()))
        if not isinstance(src, str):
            raise ModelFormatError(f"tokenizer_config.chat_template must be a string (Jinja source), got "
                                   f"{type(src).__name__}")
        special = {
            k: v for k in ("bos_token", "eos_token", "pad_token", "unk_token")
            if isinstance(v := tokenizer_config.get(k), str)
        }
        return cls(src, special)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'} dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidRequestError(f"message {i} must be a dict with string 'role' and 'content', got {m!r}")
        try:
            return self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **self._special
            )
        except TemplateError:
            raise
        except _JinjaTemplateError as e:
            raise TemplateError(f"chat template failed to render: {e}") from e
