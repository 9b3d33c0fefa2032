"""The engine's exceptions: every user-facing failure is a NanoqwenError with a one-line message.

Errors from the format package (`nanoqwen_format.NanoqwenFormatError`: a corrupt or unsupported file)
are wrapped in `ModelFormatError` by `Engine.load`, with the original chained as `__cause__`, so an
application needs to catch only `NanoqwenError`.
"""

from __future__ import annotations


class NanoqwenError(Exception):
    """Base of every error the engine raises on purpose."""


class ModelNotFoundError(NanoqwenError):
    """The path is not a .nanoqwen file, an HF folder, or a hub id that can be fetched."""


class ModelFormatError(NanoqwenError):
    """The model file or checkpoint is unreadable or has a shape the engine does not support."""


class ConfigError(ModelFormatError):
    """The model config lacks a key the engine needs, or has a value of the wrong type, out of range or
    inconsistent with another: a kind of ModelFormatError (the file is what is wrong)."""


class PromptTooLongError(NanoqwenError):
    """The prompt does not fit the context; nothing was allocated."""


class KVPagesExhaustedError(NanoqwenError):
    """The KV page pool has too few free pages; the pool and every sequence are unchanged."""


class NoGPUError(NanoqwenError):
    """device="cuda" was asked for but no usable GPU (or the CUDA backend) is available."""


class InvalidRequestError(NanoqwenError):
    """Bad sampling parameters or a malformed prompt/messages argument."""


class TemplateError(NanoqwenError):
    """The model's chat template is missing or failed to render the messages."""


class QueueFullError(NanoqwenError):
    """Engine.submit found `max_queue` requests already waiting; nothing was queued (retry later)."""


class EngineClosedError(NanoqwenError):
    """The Engine was closed: new requests are refused and requests still pending end with this error."""
