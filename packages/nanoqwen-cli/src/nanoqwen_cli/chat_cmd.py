"""`nanoqwen-cli chat`: an interactive multi-turn session that keeps the conversation's history."""

from __future__ import annotations

import sys

import click

from nanoqwen_cli import session
from nanoqwen_cli.options import model_options, sampling_options, sampling_overrides

HELP_TEXT = "commands: /reset (forget the conversation), /exit (quit), /help; Ctrl-C stops the current answer"


@click.command(short_help="Interactive multi-turn chat.")
@model_options
@sampling_options
@click.option(
    "--system", default=None, help="System message for the chat template (default: the model's own)."
)
@click.option("--quiet", "-q", is_flag=True, help="No banner, notes, or timing lines on stderr.")
def chat(model, device, max_context, system, quiet, **sampling):
    """Talk with the model; each line you type is one turn, answered with the whole history in context.

    /reset forgets the conversation, /exit (or Ctrl-D) quits, Ctrl-C stops the answer being written and
    keeps the session. Works with stdin piped (one turn per line, no `>>>` prompt): answers go to
    stdout, the banner, notes and timings to stderr.

    \b
    Examples:
        nanoqwen-cli chat --system "You are a terse senior Python reviewer."
        printf 'hi\\n/reset\\nwhat is 2+2?\\n/exit\\n' | nanoqwen-cli chat --model tiny.nanoqwen --device cpu
    """
    from nanoqwen_engine import NanoqwenError

    params = session.make_params(sampling_overrides(sampling))  # bad values fail before a load
    loaded = session.load(model, device, max_context, progress=not quiet)
    stdin = sys.stdin
    out = sys.stdout
    interactive = stdin.isatty()

    def note(text: str) -> None:
        if not quiet:
            click.echo(text, err=True)

    note(f"nanoqwen chat: {loaded.model} on {device} (loaded in {loaded.load_s:.2f} s); {HELP_TEXT}")
    history: list[dict] = []
    read_line = _terminal_reader() if interactive else stdin.readline
    while True:
        try:
            line = read_line()
        except KeyboardInterrupt:
            note("\n(Ctrl-C at the prompt: /exit or Ctrl-D quits)")
            continue
        if not line:  # EOF
            break
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        command = line.strip().lower()
        if command in ("/exit", "/quit"):
            break
        if command == "/reset":
            history.clear()
            note("(conversation reset)")
            continue
        if command == "/help":
            note(HELP_TEXT)
            continue
        if command.startswith("/"):
            note(f"unknown command {line.strip()!r}; {HELP_TEXT}")
            continue

        history.append({"role": "user", "content": line})
        request = session.messages_for_history(history, system)
        stats = session.Stats()
        reply: list[str] = []
        deltas = session.stream(loaded.engine, request, params, stats)
        try:
            for delta in deltas:
                out.write(delta)
                out.flush()
                reply.append(delta)
        except KeyboardInterrupt:
            # Stop this answer only: closing the generator frees the sequence's KV pages in the engine.
            deltas.close()
            out.write("\n")
            out.flush()
            note("(answer stopped)")
            history.append({"role": "assistant", "content": "".join(reply)})
            continue
        except NanoqwenError as exc:
            history.pop()  # the turn that failed is not part of the conversation
            click.echo(f"error: {exc}", err=True)
            note("(the conversation is unchanged; /reset starts afresh)")
            continue
        out.write("\n")
        out.flush()
        history.append({"role": "assistant", "content": "".join(reply)})
        note(session.format_stats(loaded, stats))


def _terminal_reader():
    """input() with line editing and history (readline) on a terminal; '' at EOF like readline()."""
    try:
        import readline  # noqa: F401  (importing it is what gives input() editing)
    except ImportError:
        pass

    def read() -> str:
        try:
            return input(">>> ") + "\n"
        except EOFError:
            return ""

    return read
