"""NanoqwenWriter: order and size checks, and a failing disk surfaces as one error with no file left."""

import errno

import numpy as np
import pytest
from format_testutil import small_config
from nanoqwen_format import NanoqwenFormatError, open_model
from nanoqwen_format.layout import expected_tensors
from nanoqwen_format.writer import NanoqwenWriter

CONFIG = small_config(num_hidden_layers=1, vocab_size=256)
SPECS = expected_tensors(CONFIG)


def writer(path):
    return NanoqwenWriter(path, CONFIG, SPECS, tokenizer_json="{}", tokenizer_config={}, generation_config={},
                          provenance={})


def chunks_for(spec, rng, pieces=3):
    arr = (rng.integers(0, 1 << 32, size=spec.shape, dtype=np.uint32) if spec.dtype == "uint32"
           else rng.standard_normal(spec.shape).astype(np.float16))
    return arr, np.array_split(arr, pieces) if arr.ndim else [arr]


def test_chunked_writes_round_trip(tmp_path, rng):
    written = {}
    with writer(tmp_path / "m.nanoqwen") as w:
        for s in SPECS:
            arr, parts = chunks_for(s, rng)
            written[s.name] = arr
            w.write_tensor(s.name, parts)
    with open_model(tmp_path / "m.nanoqwen", verify=True) as m:
        for name, arr in written.items():
            np.testing.assert_array_equal(m.tensor(name), arr)


def test_order_size_and_dtype_are_checked(tmp_path, rng):
    with pytest.raises(NanoqwenFormatError, match="expected model.embed_tokens.weight"):
        with writer(tmp_path / "a.nanoqwen") as w:
            w.write_tensor(SPECS[1].name, [])
    with pytest.raises(NanoqwenFormatError, match="got 2 bytes, want"):
        with writer(tmp_path / "b.nanoqwen") as w:
            w.write_tensor(SPECS[0].name, [np.zeros(1, np.float16)])
    with pytest.raises(NanoqwenFormatError, match="dtype float32, want float16"):
        with writer(tmp_path / "c.nanoqwen") as w:
            w.write_tensor(SPECS[0].name, [np.zeros(SPECS[0].shape, np.float32)])
    with pytest.raises(NanoqwenFormatError, match="never written"):
        with writer(tmp_path / "d.nanoqwen") as w:
            w.write_tensor(SPECS[0].name, [chunks_for(SPECS[0], rng)[0]])
    assert list(tmp_path.iterdir()) == []


def test_disk_error_is_one_error_and_no_file(tmp_path, rng):

    class FullDisk:
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, data):
            self.n += 1
            if self.n > 4:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    with pytest.raises(NanoqwenFormatError, match="No space left on device"):
        with writer(tmp_path / "m.nanoqwen") as w:
            w._f = FullDisk(w._f)
            for s in SPECS:
                w.write_tensor(s.name, chunks_for(s, rng)[1])
    assert list(tmp_path.iterdir()) == []


def test_unwritable_destination(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(NanoqwenFormatError, match="cannot write"):
        with writer(blocker / "sub" / "m.nanoqwen"):
            pass
