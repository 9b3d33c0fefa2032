"""Helpers shared by this package's tests (a unique module name, so running several packages' tests in
one pytest call cannot pick up another package's helpers)."""

import copy
import json
import struct

import numpy as np
from nanoqwen_format import tiny_config
from nanoqwen_format.layout import expected_tensors
from nanoqwen_format.writer import NanoqwenWriter

SMALL_VOCAB = 2048


def small_config(**overrides) -> dict:
    return tiny_config(**{"vocab_size": SMALL_VOCAB, **overrides})


def write_bare(path, config, rng: np.random.Generator ):
    """A valid .nanoqwen with random tensors and a stand-in tokenizer: tiny header, quick to damage."""
    specs = expected_tensors(config)
    with NanoqwenWriter(path, config, specs, tokenizer_json='{"model": {}}', tokenizer_config={},
                        generation_config={"eos_token_id": 1}, provenance={"source": "test"}) as w:
        for t in specs:
            if t.dtype == "uint32":
                w.write_tensor(t.name, [rng.integers(0, 1 << 32, size=t.shape, dtype=np.uint32)])
            else:
                w.write_tensor(t.name, [rng.standard_normal(t.shape).astype(np.float16)])
    return path


def split(raw: bytes):
    """(JSON header dict, JSON length) of a .nanoqwen file's bytes."""
    (n,) = struct.unpack("<Q", raw[16:24])
    return json.loads(raw[24:24 + n]), n


def relayout(raw: bytes, header: dict, text_edit=None) -> bytes:
    """The file with a new JSON header of any length: the data section moves by whole 4096-byte pages and
    every offset in the table moves with it. text_edit(bytes) -> bytes edits the JSON text as written (for
    what json.dumps cannot write: duplicate keys, NaN literals)."""
    _, n = split(raw)
    data_start = (24 + n + 4095) // 4096 * 4096
    shift = 0
    while True:
        h = copy.deepcopy(header)
        for e in h.get("tensors", []) if isinstance(h.get("tensors"), list) else []:
            if isinstance(e, dict) and isinstance(e.get("offset"), int):
                e["offset"] += shift
        text = json.dumps(h, ensure_ascii=False, separators=(",", ":")).encode()
        if text_edit is not None:
            text = text_edit(text)
        need = (24 + len(text) + 4095) // 4096 * 4096
        if need <= data_start + shift:
            break
        shift = need - data_start
    head = raw[:16] + struct.pack("<Q", len(text)) + text
    return head + b"\0" * (data_start + shift - len(head)) + raw[data_start:]
