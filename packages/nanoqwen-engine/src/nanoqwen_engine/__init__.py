"""nanoqwen_engine: load a .nanoqwen model and generate, on the GPU or with the CPU reference backend."""

from .config import ModelConfig
from .engine import Engine
from .errors import (
    ConfigError,
    EngineClosedError,
    InvalidRequestError,
    KVPagesExhaustedError,
    ModelFormatError,
    ModelNotFoundError,
    NanoqwenError,
    NoGPUError,
    PromptTooLongError,
    QueueFullError,
    TemplateError,
)
from .params import SamplingParams
from .request import Completion, GenerationEvent, RequestHandle

__version__ = "0.1.0"

__all__ = [
    "Engine", "SamplingParams", "Completion", "GenerationEvent", "RequestHandle", "ModelConfig",
    "NanoqwenError", "ModelNotFoundError", "ModelFormatError", "ConfigError", "PromptTooLongError",
    "KVPagesExhaustedError", "NoGPUError", "InvalidRequestError", "TemplateError",
    "QueueFullError", "EngineClosedError",
]
