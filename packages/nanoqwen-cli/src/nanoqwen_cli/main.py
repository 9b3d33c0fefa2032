"""The `nanoqwen-cli` command group: run, chat, convert, inspect, bench, verify, serve.

Every subcommand is thin over nanoqwen-engine / nanoqwen-format. The group owns error reporting (one
`error: ...` line, non-zero exit, a traceback only with --debug) so that each command can simply let
the engine's exceptions rise.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

from nanoqwen_cli import __version__
from nanoqwen_cli.errors import EXIT_BROKEN_PIPE, EXIT_ERROR, EXIT_INTERRUPTED, describe, show_click_error

# name -> "module:attribute"; imported on first use so that `--help` and typos answer at once, without
# loading numpy, tokenizers or CuPy. convert/inspect are nanoqwen-format's own click commands.
COMMANDS = {
    "run": "nanoqwen_cli.run_cmd:run",
    "chat": "nanoqwen_cli.chat_cmd:chat",
    "models": "nanoqwen_cli.models_cmd:models",
    "pull": "nanoqwen_cli.models_cmd:pull",
    "rm": "nanoqwen_cli.models_cmd:rm",
    "convert": "nanoqwen_cli.format_cmds:convert",
    "inspect": "nanoqwen_cli.format_cmds:inspect",
    "bench": "nanoqwen_cli.bench_cmd:bench",
    "verify": "nanoqwen_cli.verify_cmd:verify",
    "serve": "nanoqwen_cli.server.command:serve",
    "perplexity": "nanoqwen_cli.perplexity_cmd:perplexity",
}


class _NanoqwenGroup(click.Group):
    """Lazily imported subcommands; any exception from one becomes a single `error:` line."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr = COMMANDS[name].split(":")
        return getattr(importlib.import_module(module), attr)

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        """click's main, with click's own errors (usage errors included) in the one `error: ...` style."""
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except click.ClickException as exc:
            show_click_error(exc)
            sys.exit(exc.exit_code)
        except click.exceptions.Abort:
            click.echo("\ninterrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except BrokenPipeError:
            # The reader went away (`nanoqwen-cli run ... | head`): not an error worth a message. Point
            # stdout at /dev/null so that the interpreter's final flush does not raise again.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            raise click.exceptions.Exit(EXIT_BROKEN_PIPE) from None
        except KeyboardInterrupt:
            if _debug(ctx):
                raise
            click.echo("\ninterrupted", err=True)
            raise click.exceptions.Exit(EXIT_INTERRUPTED) from None
        except Exception as exc:
            if _debug(ctx):
                raise
            click.echo(f"error: {describe(exc)}", err=True)
            raise click.exceptions.Exit(EXIT_ERROR) from None


def _debug(ctx: click.Context) -> bool:
    return bool(ctx.params.get("debug")) or os.environ.get("NANOQWEN_DEBUG", "") not in ("", "0")


@click.group(
    cls=_NanoqwenGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110}
)
@click.option(
    "--debug", is_flag=True, help="Show full tracebacks instead of one-line errors (also NANOQWEN_DEBUG=1)."
)
@click.version_option(__version__, prog_name="nanoqwen-cli")
def cli(debug: bool) -> None:
    """nanoqwen: INT4 inference for Qwen2.5-Coder on NVIDIA Hopper, with a CPU reference backend.

    \b
    Start here (downloads and converts Qwen2.5-Coder-7B-Instruct once, then streams the answer):
        nanoqwen-cli run "Write a Python function that checks whether a number is prime."

    \b
    Without a GPU, the CPU reference backend runs the 1.5B model (slowly: minutes per answer):
        nanoqwen-cli pull Qwen/Qwen2.5-Coder-1.5B-Instruct        # download + convert, once
        nanoqwen-cli run --device cpu -m Qwen/Qwen2.5-Coder-1.5B-Instruct "def fib(n):" --raw -n 32

    \b
    Models are cached under $NANOQWEN_CACHE (default ~/.cache/nanoqwen): `nanoqwen-cli models` lists
    them, `nanoqwen-cli rm NAME` removes one. Run `nanoqwen-cli COMMAND --help` for each command's flags
    and an example. Shell completion (bash; zsh and fish alike):
        eval "$(_NANOQWEN_CLI_COMPLETE=bash_source nanoqwen-cli)"
    """
