"""`python -m nanoqwen_cli ...` is `nanoqwen-cli ...` (the GPU machine runs the project from source)."""

from nanoqwen_cli.main import cli

if __name__ == "__main__":
    cli(prog_name="nanoqwen-cli")
