"""nanoqwen-format: the .nanoqwen file (one self-contained, mmap-able file per model), its symmetric INT4
group-128 quantizer, the ValueShuffle-v1 nibble packing, and the Hugging Face -> .nanoqwen converter.

docs/FORMAT.md is the normative description of the bytes; docs/INTERFACES.md sections 1-2 fix these names.
"""

import sys as _sys

__version__ = "0.1.0"

from .converter import convert  # noqa: E402
from .errors import NanoqwenFormatError  # noqa: E402
from .layout import expected_tensors  # noqa: E402
from .quantize import dequantize_int4, quantize_int4  # noqa: E402
from .reader import NanoqwenFile, open_model  # noqa: E402
from .synthetic import tiny_config, write_synthetic  # noqa: E402
from .valueshuffle import pack_valueshuffle, unpack_valueshuffle  # noqa: E402

# `from nanoqwen_format.convert import convert` (nanoqwen-engine's model_source.py) names converter.py
# through this alias. A real submodule called `convert` would rebind the package attribute `convert` from
# the function to the module when imported; a module already in sys.modules is returned as is, so the
# attribute stays the function.
_sys.modules[f"{__name__}.convert"] = _sys.modules[f"{__name__}.converter"]

__all__ = [
    "NanoqwenFile", "NanoqwenFormatError", "convert", "dequantize_int4", "expected_tensors", "open_model",
    "pack_valueshuffle", "quantize_int4", "tiny_config", "unpack_valueshuffle", "write_synthetic",
]

