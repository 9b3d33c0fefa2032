"""nanoqwen_engine: load a .nanoqwen model and generate, on the GPU or with the CPU reference backend."""

from .config import ModelConfig
from .engine import Completion, Engine, GenerationEvent
from .errors import (
    ConfigError,
    InvalidRequestError,
    KVPagesExhaustedError,
    ModelFormatError,
    ModelNotFoundError,
    NanoqwenError,
    NoGPUError,
    PromptTooLongError,
    TemplateError,
)
from .params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "Engine", "SamplingParams", "Completion", "GenerationEvent", "ModelConfig",
    "NanoqwenError", "ModelNotFoundError", "ModelFormatError", "ConfigError", "PromptTooLongError",
    "KVPagesExhaustedError", "NoGPUError", "InvalidRequestError", "TemplateError",
]
