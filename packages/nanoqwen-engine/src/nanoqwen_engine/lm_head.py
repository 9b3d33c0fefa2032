"""The lm_head's storage, `lm_head_dtype`: one choice for both backends, resolved in one place.

"int8" (the default): the lm_head is quantized once at load to int8 with one fp16 scale per 128 values
along K (nanoqwen_kernels.head_i8 has the rule), and every path multiplies those values. Why: at batch 1
the lm_head is the largest single read of a decode step (7B: 1.09 GB of 4.46 GB) and int8 halves it; the
rounding is finer than the Q6_K that llama.cpp's Q4_K_M files ship their output matrix in. "fp16": the
file's values as they are (the behaviour before the option existed).

Both backends take the same choice because the validation ladder compares them token by token: the
GPU's batch-1 GEMV multiplies s * q with fp32 sums, its batches of 2 or more and score() the fp16 copy
fp16(s * q), and the CPU reference s * q in float32.
"""

from __future__ import annotations

import os

from .errors import InvalidRequestError

LM_HEAD_DTYPES = ("int8", "fp16")
DEFAULT_LM_HEAD_DTYPE = "int8"
LM_HEAD_DTYPE_ENV = "NANOQWEN_LM_HEAD_DTYPE"


def lm_head_dtype_arg(value: str | None) -> str:
    """`value`, else $NANOQWEN_LM_HEAD_DTYPE, else "int8"; InvalidRequestError naming where a value outside
    LM_HEAD_DTYPES came from and listing the choices."""
    if value is not None:
        if value not in LM_HEAD_DTYPES:
            raise InvalidRequestError(f"lm_head_dtype must be one of {LM_HEAD_DTYPES}, got {value!r}")
        return value
    env = os.environ.get(LM_HEAD_DTYPE_ENV)
    if not env:
        return DEFAULT_LM_HEAD_DTYPE
    if env not in LM_HEAD_DTYPES:
        raise InvalidRequestError(f"lm_head_dtype from ${LM_HEAD_DTYPE_ENV} must be one of {LM_HEAD_DTYPES}, "
                                  f"got {env!r}")
    return env
