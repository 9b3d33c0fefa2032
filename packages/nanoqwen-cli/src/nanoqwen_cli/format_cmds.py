"""`nanoqwen-cli convert` and `nanoqwen-cli inspect`: nanoqwen-format's own click commands.

Re-exported (a shallow copy of the command object, not a wrapper) so the flags stay exactly those of
`nanoqwen-convert`; only the help gains an example written for `nanoqwen-cli`.
"""

from __future__ import annotations

import copy

import click
from nanoqwen_format import cli as format_cli

_CONVERT_EXAMPLES = """

\b
Examples:
    nanoqwen-cli convert Qwen/Qwen2.5-Coder-7B-Instruct -o qwen7b.nanoqwen
    nanoqwen-cli convert ./my-qwen2-checkpoint -o model.nanoqwen --force
"""

_INSPECT_EXAMPLES = """

\b
Examples:
    nanoqwen-cli inspect qwen7b.nanoqwen
    nanoqwen-cli inspect qwen7b.nanoqwen --verify --json
"""


def _with_examples(command: click.Command, examples: str) -> click.Command:
    command = copy.copy(command)
    command.help = (command.help or "").rstrip() + examples
    return command


convert = _with_examples(format_cli.convert_command, _CONVERT_EXAMPLES)
inspect = _with_examples(format_cli.inspect_command, _INSPECT_EXAMPLES)
