"""How a failure reaches the user: one line `error: ...` on stderr and a non-zero exit code.

The engine, format and kernels packages raise their own exception types with one-line messages; this
module turns those, and the few foreign exceptions a user can provoke (a missing file, an offline hub,
memory), into that line. A traceback is shown only with `nanoqwen-cli --debug` (or NANOQWEN_DEBUG=1),
because a user who typed a wrong path needs the path, not the stack.
"""

from __future__ import annotations

import errno

EXIT_ERROR = 1  # any failure the message explains
EXIT_USAGE = 2  # a bad flag or argument (click's own code for usage errors)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: the reader of stdout closed it


class CliError(Exception):
    """A failure detected by the CLI itself (bad combination of flags, empty prompt, ...)."""


def _is_instance_by_name(exc: BaseException, names: set[str]) -> bool:
    # huggingface_hub and CuPy are optional here (imported lazily by the packages that use them, absent
    # on a CPU-only install), so their exceptions are matched by class name along the MRO instead of
    # being imported. Our own packages' exceptions are matched with isinstance (describe()).
    return any(cls.__name__ in names for cls in type(exc).__mro__)


_HUB_OFFLINE = {"OfflineModeIsEnabled", "LocalEntryNotFoundError"}
_HUB_MISSING = {"RepositoryNotFoundError", "RevisionNotFoundError", "EntryNotFoundError", "GatedRepoError"}
_NETWORK = {"ConnectionError", "ConnectTimeout", "ReadTimeout", "Timeout", "HfHubHTTPError", "HTTPError"}
_GPU_OOM = {"OutOfMemoryError"}  # cupy.cuda.memory.OutOfMemoryError
_CUDA_ERRORS = {"CUDARuntimeError", "CUDADriverError", "CompileException"}
# Third-party exceptions matched by class name (their packages are not imported to match them), first
# match wins: the message for each.
_BY_NAME = (
    (_HUB_OFFLINE, "the model is not in the local Hugging Face cache and the hub cannot be reached "
                   "(offline mode or no network): {text}"),
    (_HUB_MISSING, "no such model on the Hugging Face hub: {text}"),
    (_GPU_OOM, "out of GPU memory: {text} (try a smaller --max-context)"),
    (_CUDA_ERRORS, "CUDA error: {text}"),
    (_NETWORK, "network error while fetching the model: {text}"),
)
_FILE_ERRORS = (  # OSErrors about one file: what went wrong, then the file
    (FileNotFoundError, "file not found"),
    (IsADirectoryError, "is a directory, expected a file"),
    (PermissionError, "permission denied"),
)


def describe(exc: BaseException) -> str:
    """The one line (without the `error: ` prefix) that explains `exc` to a user."""
    # Imported here, not at the top: `nanoqwen-cli --help` must not pay for numpy and the tokenizer.
    from nanoqwen_engine import NanoqwenError, NoGPUError, PromptTooLongError
    from nanoqwen_format import NanoqwenFormatError
    from nanoqwen_kernels import KernelError

    text = _first_line(exc)
    if isinstance(exc, CliError):
        return text
    if isinstance(exc, NoGPUError) and "--device cpu" not in text:
        return f"{text} ({cpu_hint()})"
    if isinstance(exc, PromptTooLongError) and "--max-context" not in text:
        return f"{text} (a larger --max-context makes room, up to the model's limit)"
    if isinstance(exc, NanoqwenError | NanoqwenFormatError | KernelError):
        return text
    for names, template in _BY_NAME:
        if _is_instance_by_name(exc, names):
            return template.format(text=text)
    if isinstance(exc, MemoryError):
        return "out of memory (host RAM); try a smaller model or --max-context"
    for kind, what in _FILE_ERRORS:
        if isinstance(exc, kind):
            return f"{what}: {exc.filename or text}"
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return f"no space left on device: {exc.filename or text}"
    if isinstance(exc, OSError):
        return f"{exc.filename}: {exc.strerror or text}" if exc.filename else text
    return (
        f"unexpected {type(exc).__name__}: {text} (rerun with `nanoqwen-cli --debug ...` for the traceback)"
    )


# What runs without a GPU: the CPU reference backend (numpy float32) with the smallest real model the
# kernels' head_dim covers. It is slow (on 2 cores a 1.5B-shaped model reads ~2 prompt tokens per second
# and takes ~15 s per generated token), which the hint says so that nobody waits for the 7B on a CPU.
CPU_MODEL = "Qwen/Qwen2.5-Coder-1.5B-Instruct"


def cpu_hint() -> str:
    return (
        f"without a GPU, the CPU reference backend runs a small model, slowly: nanoqwen-cli run --device cpu "
        f'--model {CPU_MODEL} "..."'
    )


def show_click_error(exc) -> None:
    """Print a click.ClickException as click does (usage and hint for a usage error), but with the last
    line in the one style, `error: <message>`, instead of click's `Error: <message>`."""
    import io

    import click

    buf = io.StringIO()
    exc.show(file=buf)
    text = buf.getvalue()
    click_line = f"Error: {exc.format_message()}\n"
    if text.endswith(click_line):
        text = text[: -len(click_line)] + f"error: {exc.format_message()}\n"
    click.echo(text, err=True, nl=False)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
