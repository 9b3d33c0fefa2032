"""`nanoqwen-cli chat`: an interactive multi-turn session that keeps the conversation's history.

Turns are read by chat_input.TurnReader (a paste or a \"\"\" block is one turn), the state lives in
conversation.Conversation (history, system message, settings, JSON files); this module runs the loop
and the slash commands.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from nanoqwen_cli import session
from nanoqwen_cli.chat_input import TurnReader
from nanoqwen_cli.conversation import Conversation
from nanoqwen_cli.errors import CliError, describe
from nanoqwen_cli.options import (
    SETTINGS,
    decode_activations_option,
    lm_head_dtype_option,
    model_options,
    sampling_options,
    sampling_overrides,
)

HELP_TEXT = f"""\
  /set temperature 0     a sampling setting: {", ".join(SETTINGS)}
                         (/set NAME alone: back to the model's default; /set seed -1: a fresh seed)
  /set system TEXT       the system message (/set system alone: the model's default)
  /set                   show the settings
  /clear                 forget the conversation (also /reset)
  /save FILE             the conversation, system message and settings, as JSON
  /load FILE             continue a saved conversation
  /bye                   quit (also /exit, /quit, Ctrl-D)
  \"\"\"                    starts a multi-line message, ended by a line ending in \"\"\"; a paste is one message
  Ctrl-C                 stops the answer being written"""

QUIT = ("/bye", "/exit", "/quit")


@click.command(short_help="Interactive multi-turn chat.")
@model_options
@lm_head_dtype_option
@decode_activations_option
@sampling_options
@click.option(
    "--system", default=None, help="System message for the chat template (default: the model's own)."
)
@click.option("--quiet", "-q", is_flag=True, help="No banner, notes, or timing lines on stderr.")
def chat(model, device, max_context, lm_head_dtype, decode_activations, system, quiet, **sampling):
    """Talk with the model; each message is answered with the whole conversation in context.

    On a terminal, lines that arrive together (a paste) are one message, and \"\"\" ... \"\"\" spans
    several lines. /set changes sampling settings and the system message, /clear forgets the
    conversation, /save and /load keep it in a JSON file, /bye (or Ctrl-D) quits, /help lists all;
    Ctrl-C stops the answer being written and keeps the session. When the conversation outgrows the
    context, its oldest turns are dropped (with a note). With stdin piped, each line is one message:
    answers go to stdout, the banner, notes and timings to stderr.

    \b
    Examples:
        nanoqwen-cli chat --system "You are a terse senior Python reviewer."
        printf 'hi\\n/set temperature 0\\nwhat is 2+2?\\n/bye\\n' | nanoqwen-cli chat --device cpu
    """
    overrides = sampling_overrides(sampling)
    session.make_params(overrides)  # bad values fail before a load
    loaded = session.load(model, device, max_context, progress=not quiet, lm_head_dtype=lm_head_dtype,
                          decode_activations=decode_activations)
    _Chat(loaded, Conversation(system, overrides), TurnReader(), quiet).loop()


class _Chat:
    def __init__(self, loaded: session.Loaded, conv: Conversation, reader: TurnReader, quiet: bool):
        self.loaded, self.conv, self.reader, self.quiet = loaded, conv, reader, quiet
        self.engine = loaded.engine
        self.out = sys.stdout
        self.capped_once = False

    def note(self, text: str) -> None:
        if not self.quiet:
            click.echo(text, err=True)

    def loop(self) -> None:
        self.note(
            f"nanoqwen chat: {self.loaded.model} on {self.loaded.device} (loaded in {self.loaded.load_s:.2f} s, "
            f"context {self.engine.max_context} tokens); /help for commands, Ctrl-D quits"
        )
        while True:
            try:
                text = self.reader.read()
            except KeyboardInterrupt:
                self.note("\n(Ctrl-C at the prompt: /bye or Ctrl-D quits)")
                continue
            if text is None:  # end of input
                if self.reader.interactive:
                    self.out.write("\n")  # the shell's prompt then starts on its own line, not after >>>
                    self.out.flush()
                return
            stripped = text.strip()
            if not stripped:
                continue
            if stripped.startswith("/") and "\n" not in stripped:
                if self.command(stripped):
                    return
                continue
            self.turn(text)

    # -- slash commands --

    def command(self, line: str) -> bool:
        """Run one /command; True to quit."""
        name, _, arg = line.partition(" ")
        name, arg = name.lower(), arg.strip()
        try:
            if name in QUIT:
                return True
            if name in ("/clear", "/reset"):
                self.conv.messages.clear()
                self.note("(conversation cleared)")
            elif name in ("/help", "/?"):
                click.echo(HELP_TEXT, err=True)
            elif name == "/set":
                self.set(arg)
            elif name == "/save":
                path = self._path(arg, "/save")
                self.conv.save(path, self.loaded.model)
                self.note(f"(saved {len(self.conv.messages)} messages to {path})")
            elif name == "/load":
                path = self._path(arg, "/load")
                self.conv = Conversation.load(path)
                self.note(
                    f"(loaded {len(self.conv.messages)} messages, the system message and settings from {path})"
                )
            else:
                self.note(f"unknown command {name!r}; /help lists the commands")
        except click.BadParameter as e:
            click.echo(f"error: {e.format_message()}", err=True)
        except CliError as e:
            click.echo(f"error: {e}", err=True)
        return False

    @staticmethod
    def _path(arg: str, command: str) -> Path:
        if not arg:
            raise CliError(f"{command} needs a file name, e.g. {command} chat.json")
        return Path(arg).expanduser()

    def set(self, arg: str) -> None:
        if not arg:
            shown = {"system": self.conv.system, **self.conv.settings}
            given = ", ".join(f"{k} = {v!r}" for k, v in shown.items() if v is not None)
            click.echo(
                f"settings: {given or 'all from the model'} (the rest: the model's generation_config)",
                err=True,
            )
            return
        name, _, value = arg.partition(" ")
        value = value.strip()
        self.note(f"({self.conv.set(name, value or None)})")

    # -- one turn --

    def turn(self, text: str) -> None:
        from nanoqwen_engine import NanoqwenError

        engine, conv = self.engine, self.conv
        try:
            params = session.make_params(conv.settings)
            budget = engine.max_context - min(
                params.resolve(engine.generation_config).max_tokens, engine.max_context // 4
            )  # room kept for the answer
            alone = len(engine.encode_prompt(Conversation(conv.system).request(text)))
            if alone > engine.max_context:
                raise CliError(
                    f"the prompt is {alone} tokens with the chat template; the context holds "
                    f"{engine.max_context} (a larger --max-context makes room, up to the model's limit)"
                )
            dropped, n_prompt = conv.fit(lambda messages: len(engine.encode_prompt(messages)), text, budget)
        except (NanoqwenError, CliError) as exc:
            click.echo(f"error: {describe(exc)}", err=True)
            self.note("(the conversation is unchanged)")
            return
        if dropped:
            self.note(
                f"(dropped the {dropped} oldest turn{'s' if dropped > 1 else ''} to fit the context of "
                f"{engine.max_context} tokens)"
            )
        params, cap_note = session.fit_max_tokens(engine, n_prompt, params)
        if cap_note and not self.capped_once:
            self.capped_once = True
            self.note(cap_note)

        conv.messages.append({"role": "user", "content": text})
        stats = session.Stats()
        reply: list[str] = []
        deltas = session.stream(
            engine, conv.request(), params, stats, prompt_tokens=n_prompt, show_progress=not self.quiet
        )
        try:
            for delta in deltas:
                self.out.write(delta)
                self.out.flush()
                reply.append(delta)
        except KeyboardInterrupt:
            # Stop this answer only: closing the generator cancels the request and frees its KV pages.
            deltas.close()
            self.out.write("\n")
            self.out.flush()
            self.note("(answer stopped)")
            conv.messages.append({"role": "assistant", "content": "".join(reply)})
            return
        except NanoqwenError as exc:
            conv.messages.pop()  # the turn that failed is not part of the conversation
            click.echo(f"error: {describe(exc)}", err=True)
            self.note("(the conversation is unchanged; /clear starts afresh)")
            return
        self.out.write("\n")
        self.out.flush()
        conv.messages.append({"role": "assistant", "content": "".join(reply)})
        self.note(session.format_stats(stats, show_seed=session.sampled(engine, params)))
