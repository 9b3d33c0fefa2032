"""The test packer agrees with the contract (docs/INTERFACES.md section 2) and with the kernel's unpack
spelled out in numpy (what the four prmt.b32 and the hsub2 compute)."""

import numpy as np
from refs import pack_valueshuffle


def test_worked_example():
    u = np.arange(8, dtype=np.uint8)[None, :]
    assert pack_valueshuffle(u)[0, 0] == 0x73625140


def _prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * i)) & 0x7] << (8 * i) for i in range(4))


def test_prmt_unpack_recovers_values(rng):
    u = rng.integers(0, 16, size=(1, 64), dtype=np.uint8)
    words = pack_valueshuffle(u)[0]
    out = []
    for w in map(int, words):
        lo, hi = w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F
        for src, sel in ((lo, 0x4140), (lo, 0x4342), (hi, 0x4140), (hi, 0x4342)):
            h2 = np.array([_prmt(src, 0x64646464, sel)], dtype=np.uint32).view(np.float16)
            out += list(h2.astype(np.float32) - 1032.0)
    np.testing.assert_array_equal(np.array(out), u[0].astype(np.float32) - 8.0)
