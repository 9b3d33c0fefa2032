"""A chat's state: the messages so far, the system message and the sampling settings; trimmed to fit
the context, saved to and loaded from JSON.

The JSON file (`/save FILE`, `/load FILE`):

    {"format": "nanoqwen-chat", "version": 1, "model": "...", "system": null or "...",
     "settings": {"temperature": 0.0, ...}, "messages": [{"role": "user", "content": "..."}, ...]}

`messages` alternate user / assistant turns (the last answer may be missing after a failed turn is
dropped: it is not saved). `settings` holds only values the user set (flags or /set); the model's
generation_config decides the rest.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import click

from nanoqwen_cli.errors import CliError
from nanoqwen_cli.options import SETTINGS

FORMAT = "nanoqwen-chat"
VERSION = 1
ROLES = ("user", "assistant")


@dataclass
class Conversation:
    system: str | None = None
    settings: dict = field(default_factory=dict)  # SamplingParams overrides, by field name
    messages: list[dict] = field(default_factory=list)

    def request(self, pending: str | None = None) -> list[dict]:
        """The messages to send: system (if set), the history, and the pending user turn."""
        from nanoqwen_cli.session import messages_for_history

        history = self.messages + ([{"role": "user", "content": pending}] if pending is not None else [])
        return messages_for_history(history, self.system)

    def fit(self, count_tokens, pending: str, budget: int) -> tuple[int, int]:
        """Drop the oldest turns (a user message and its answer) until the request with `pending`
        counts at most `budget` tokens, or no turn is left to drop. Returns (turns dropped, the
        request's token count after)."""
        dropped = 0
        n = count_tokens(self.request(pending))
        while n > budget and self.messages:
            del self.messages[
                : 2 if len(self.messages) > 1 and self.messages[1]["role"] == "assistant" else 1
            ]
            dropped += 1
            n = count_tokens(self.request(pending))
        return dropped, n

    def set(self, name: str, value: str | None) -> str:
        """/set NAME VALUE (VALUE None: back to the model's default); returns what changed, in words.
        click.BadParameter names the flag and its range; CliError for an unknown name."""
        from nanoqwen_cli.options import find_setting

        if name == "system":
            self.system = value
            return "system message " + ("set" if value is not None else "back to the model's default")
        setting = find_setting(name)
        if setting is None:
            raise CliError(f"no setting {name!r}; /set takes system or one of: {', '.join(SETTINGS)}")
        if value is None:
            self.settings.pop(setting.field, None)
            return f"{setting.field} back to the model's default"
        parsed = setting.parse(value)
        if parsed is None:  # seed -1: a fresh random seed per answer
            self.settings.pop(setting.field, None)
            return f"{setting.field}: a fresh random seed per answer"
        self.settings[setting.field] = parsed
        return f"{setting.field} = {parsed}"

    # -- files --

    def save(self, path: Path, model: str) -> None:
        data = {
            "format": FORMAT,
            "version": VERSION,
            "model": model,
            "system": self.system,
            "settings": self.settings,
            "messages": self.messages,
        }
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise CliError(f"{path}: cannot write: {e.strerror or e}") from None

    @classmethod
    def load(cls, path: Path) -> Conversation:
        """The conversation in `path`; CliError naming the file and what is wrong with it."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise CliError(f"{path}: cannot read: {e.strerror or e}") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise CliError(f"{path}: not a JSON file ({e})") from None

        def bad(what: str):
            return CliError(f"{path}: not a saved chat: {what}")

        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise bad(f'no "format": "{FORMAT}"')
        if data.get("version") != VERSION:
            raise bad(f"version {data.get('version')!r}, this nanoqwen-cli reads version {VERSION}")
        system = data.get("system")
        if system is not None and not isinstance(system, str):
            raise bad('"system" must be a string or null')
        messages = data.get("messages", [])
        if not isinstance(messages, list):
            raise bad('"messages" must be a list')
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
                raise bad(f'message {i} is not {{"role": "user" or "assistant", "content": text}}')
        settings = data.get("settings", {})
        if not isinstance(settings, dict):
            raise bad('"settings" must be an object')
        checked = {}
        for name, value in settings.items():
            if name == "stop":  # --stop's strings (no /set for them: they come from the flag)
                if not (isinstance(value, list) and all(isinstance(x, str) and x for x in value)):
                    raise bad('"stop" must be a list of non-empty strings')
                checked[name] = list(value)
                continue
            if name not in SETTINGS:
                raise bad(f"unknown setting {name!r}")
            try:
                checked[name] = SETTINGS[name].parse(str(value))
            except click.BadParameter as e:
                raise bad(e.format_message()) from None
        return cls(
            system,
            {k: v for k, v in checked.items() if v is not None},
            [{"role": m["role"], "content": m["content"]} for m in messages],
        )
