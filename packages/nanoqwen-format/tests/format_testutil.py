"""Helpers shared by this package's tests (a unique module name, so running several packages' tests in
one pytest call cannot pick up another package's helpers)."""

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
