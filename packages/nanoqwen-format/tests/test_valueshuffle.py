"""ValueShuffle-v1 packing: exact inverses, the worked word, and the bit layout written out by hand."""

import numpy as np
import pytest
from nanoqwen_format import NanoqwenFormatError, pack_valueshuffle, unpack_valueshuffle


def test_worked_example_word():
    u = np.arange(8, dtype=np.uint8)[None, :]
    words = pack_valueshuffle(u)
    assert words.dtype == np.uint32 and words.shape == (1, 1)
    assert int(words[0, 0]) == 0x73625140
    np.testing.assert_array_equal(unpack_valueshuffle(words), u)


def test_unpack_then_pack_random_words(rng):
    words = rng.integers(0, 1 << 32, size=(7, 19), dtype=np.uint32)
    u = unpack_valueshuffle(words)
    assert u.shape == (7, 152) and u.max() <= 15
    np.testing.assert_array_equal(pack_valueshuffle(u), words)


def test_pack_then_unpack_random_values(rng):
    u = rng.integers(0, 16, size=(5, 1024), dtype=np.uint8)
    np.testing.assert_array_equal(unpack_valueshuffle(pack_valueshuffle(u)), u)


def test_bit_positions_match_the_diagram(rng):
    """bits 4i..4i+3 of byte i... : nibble at bit 8i is u[k+i], at bit 8i+4 is u[k+4+i]."""
    u = rng.integers(0, 16, size=(3, 64), dtype=np.uint8)
    words = pack_valueshuffle(u)
    for r in range(3):
        for w in range(8):
            word = int(words[r, w])
            for i in range(4):
                assert (word >> (8 * i)) & 0xF == u[r, 8 * w + i]
                assert (word >> (8 * i + 4)) & 0xF == u[r, 8 * w + 4 + i]


def test_little_endian_bytes():
    u = np.arange(8, dtype=np.uint8)[None, :]
    assert pack_valueshuffle(u).tobytes() == bytes([0x40, 0x51, 0x62, 0x73])


def test_refuses_bad_input():
    with pytest.raises(NanoqwenFormatError, match="0..15"):
        pack_valueshuffle(np.full((1, 8), 16, np.uint8))
    with pytest.raises(NanoqwenFormatError, match="multiple of 8"):
        pack_valueshuffle(np.zeros((1, 12), np.uint8))
    with pytest.raises(NanoqwenFormatError, match="uint32"):
        unpack_valueshuffle(np.zeros((1, 2), np.int64))
