"""nanoqwen_format."""
__version__ = "0.1.0"
