"""nanoqwen_engine."""
__version__ = "0.1.0"
