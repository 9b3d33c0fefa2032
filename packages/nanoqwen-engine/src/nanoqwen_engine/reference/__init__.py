"""The CPU reference backend ("the simulation"): numpy float32 Qwen2 forward over the paged cache."""

from .backend import ReferenceBackend

__all__ = ["ReferenceBackend"]
