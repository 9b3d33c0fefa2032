"""Shared fixtures: small synthetic Qwen2 checkpoints and .nanoqwen files, built once per session.

Most tests use a 2048-entry vocabulary: the format does not care about vocab size, and the real 152064
would make every checkpoint ~160 MB. test_synthetic.py uses the full tiny_config() where it matters.
"""

import numpy as np
import pytest
from nanoqwen_format import tiny_config, write_synthetic
from nanoqwen_format.layout import expected_tensors
from nanoqwen_format.synthetic import write_hf_checkpoint
from nanoqwen_format.writer import NanoqwenWriter

SMALL_VOCAB = 2048


def small_config(**overrides) -> dict:
    return tiny_config(**{"vocab_size": SMALL_VOCAB, **overrides})


@pytest.fixture(scope="session")
def hf_untied(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("hf_untied"), small_config(), seed=11)


@pytest.fixture(scope="session")
def hf_tied_sharded(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("hf_tied"), small_config(tie_word_embeddings=True),
                               seed=12, shards=3)


@pytest.fixture(scope="session")
def synthetic_file(tmp_path_factory):
    """A valid small .nanoqwen (untied) that malformation tests copy and damage."""
    path = tmp_path_factory.mktemp("syn") / "small.nanoqwen"
    write_synthetic(path, small_config(), seed=int(np.random.default_rng().integers(1 << 30)))
    return path


def write_bare(path, config):
    """A valid .nanoqwen with random tensors and a stand-in tokenizer: tiny header, quick to damage."""
    rng = np.random.default_rng()
    specs = expected_tensors(config)
    with NanoqwenWriter(path, config, specs, tokenizer_json='{"model": {}}', tokenizer_config={},
                        generation_config={"eos_token_id": 1}, provenance={"source": "test"}) as w:
        for t in specs:
            if t.dtype == "uint32":
                w.write_tensor(t.name, [rng.integers(0, 1 << 32, size=t.shape, dtype=np.uint32)])
            else:
                w.write_tensor(t.name, [rng.standard_normal(t.shape).astype(np.float16)])
    return path


@pytest.fixture(scope="session")
def bare_file(tmp_path_factory):
    """2 layers, vocab 256, untied: the file malformation tests copy and damage."""
    return write_bare(tmp_path_factory.mktemp("bare") / "bare.nanoqwen", small_config(vocab_size=256))
