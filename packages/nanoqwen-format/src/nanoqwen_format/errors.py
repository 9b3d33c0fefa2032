"""The package's one exception type."""


class NanoqwenFormatError(Exception):
    """A .nanoqwen file, a Hugging Face checkpoint or an argument is not what this package accepts.

    The message names the problem in one line (the CLI prints it as is, without a traceback).
    """
