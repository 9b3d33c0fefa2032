"""Strict reading of untrusted input: the .nanoqwen JSON header, safetensors headers, the HF JSON files.

One copy of each rule, shared by the reader and the converter's safetensors reader, so both refuse the
same things: JSON with duplicate keys or non-finite numbers, shapes and integers beyond fixed bounds
(checked before any arithmetic: a product of 100,000 huge dimensions is never computed), byte ranges
that overlap. Every refusal is one NanoqwenFormatError naming the thing, whose message quotes untrusted
values through `short` (a 2 MB shape list is shown as its first few items).
"""

import json
import math
import os
import reprlib
import stat

from .errors import NanoqwenFormatError

MAX_RANK = 8  # dimensions of a tensor's shape (every v1 tensor has 1 or 2; safetensors checkpoints <= 4)
MAX_DIM = 1 << 40  # one dimension; far above any Qwen2 dimension (vocab 152064, intermediate 29568)
MAX_BYTES = 1 << 62  # any byte count or offset: above every real file, and products stay small integers

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = _repr.maxlong = 60
_repr.maxlist = _repr.maxdict = _repr.maxtuple = 6
_repr.maxlevel = 2


def short(value) -> str:
    """repr() of an untrusted value, at most ~100 characters however large the value."""
    try:
        return _repr.repr(value)
    except (ValueError, RecursionError):  # an int past Python's 4300-digit str limit, a deep structure
        return f"<{type(value).__name__}>"


def label(value) -> str:
    """An untrusted name as it reads in a message: a string unquoted (shortened past 60 characters),
    anything else as short()."""
    if isinstance(value, str):
        return value if len(value) <= 60 else value[:28] + "..." + value[-28:]
    return short(value)


def is_int(v) -> bool:
    """A JSON integer: Python int, not bool (true/false are not integers)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_finite_number(v) -> bool:
    """An int or float (not bool) that is finite as a float64: 10**400 is not (float() overflows)."""
    if not is_int(v) and not isinstance(v, float):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def int_in(v, lo: int, hi: int) -> bool:
    return is_int(v) and lo <= v <= hi


def loads(text, what: str):
    """json.loads that refuses duplicate keys and NaN/Infinity (also 1e999, which parses to inf).

    text: str, or bytes in UTF-8. `what` names the document in the error."""
    def no_duplicates(pairs):
        obj = dict(pairs)
        if len(obj) != len(pairs):
            seen = set()
            dup = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise NanoqwenFormatError(f"{what}: duplicate key {short(dup)} in one JSON object")
        return obj

    def no_constant(name):
        raise NanoqwenFormatError(f"{what}: {name} is not JSON (NaN or Infinity do not appear)")

    def finite_float(s):
        x = float(s)
        if not math.isfinite(x):
            raise NanoqwenFormatError(f"{what}: {short(s)} is not a finite number")
        return x

    try:
        if isinstance(text, bytes | bytearray | memoryview):
            text = bytes(text).decode("utf-8")
        return json.loads(text, object_pairs_hook=no_duplicates, parse_constant=no_constant,
                          parse_float=finite_float)
    except UnicodeDecodeError as e:
        raise NanoqwenFormatError(f"{what} is not valid UTF-8: {e.reason} at byte {e.start}") from None
    except RecursionError:
        raise NanoqwenFormatError(f"{what}: JSON nested too deeply") from None
    except json.JSONDecodeError as e:
        raise NanoqwenFormatError(f"{what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except ValueError as e:  # an integer literal past Python's digit limit
        raise NanoqwenFormatError(f"{what} is not usable JSON: {str(e)[:120]}") from None


def shape_nbytes(shape, itemsize: int, what: str) -> int:
    """Bytes of a tensor of `shape`: a list of at most MAX_RANK integers in 0..MAX_DIM, checked before
    the product is taken."""
    if not isinstance(shape, list):
        raise NanoqwenFormatError(f"{what}: shape {short(shape)} is not a list of dimensions")
    if len(shape) > MAX_RANK:
        raise NanoqwenFormatError(f"{what}: shape {short(shape)} has {len(shape)} dimensions (at most {MAX_RANK})")
    if not all(int_in(d, 0, MAX_DIM) for d in shape):
        raise NanoqwenFormatError(f"{what}: shape {short(shape)}: dimensions must be integers in 0..2^40")
    n = itemsize * math.prod(shape)  # < 2^(40*8 + 3): a small integer, computed in microseconds
    if n > MAX_BYTES:
        raise NanoqwenFormatError(f"{what}: shape {short(shape)} is larger than any file ({n:.3e} bytes)")
    return n


def check_disjoint(spans, what: str) -> None:
    """spans: (start, end, name) byte ranges [start, end); refuses the first two that overlap."""
    ordered = sorted(spans, key=lambda s: (s[0], s[1]))
    for (_, end_a, a), (start_b, _, b) in zip(ordered, ordered[1:], strict=False):
        if start_b < end_a:
            raise NanoqwenFormatError(f"{what} {short(a)} and {short(b)} overlap")


def open_regular(path, label=None):
    """(binary file, size) of a regular file, or one error: missing, unreadable, or not a
    regular file. O_NONBLOCK makes opening a FIFO return at once (a plain open waits for a writer for
    ever); fstat then refuses it, and a device or a folder too."""
    label = label or str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise NanoqwenFormatError(f"cannot open {label}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NanoqwenFormatError(f"cannot open {label}: not a regular file")
        os.set_blocking(fd, True)
        return open(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise
