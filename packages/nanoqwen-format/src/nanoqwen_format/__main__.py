"""python -m nanoqwen_format ...  ==  nanoqwen-convert ..."""

from .cli import main

main(prog_name="nanoqwen-convert")
