"""Shared fixtures: small synthetic Qwen2 checkpoints and .nanoqwen files, built once per session.

Most tests use a 2048-entry vocabulary: the format does not care about vocab size, and the real 152064
would make every checkpoint ~160 MB. test_synthetic.py uses the full tiny_config() where it matters.
"""

import numpy as np
import pytest
from nanoqwen_format import tiny_config, write_synthetic
from nanoqwen_format.synthetic import write_hf_checkpoint

SMALL_VOCAB = 2048


def small_config(**overrides) -> dict:
    return tiny_config(vocab_size=SMALL_VOCAB, **overrides)


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
