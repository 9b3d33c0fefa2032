"""Shared fixtures: small synthetic Qwen2 checkpoints and .nanoqwen files, built once per session.

Most tests use a 2048-entry vocabulary: the format does not care about vocab size, and the real 152064
would make every checkpoint ~160 MB. test_synthetic.py uses the full tiny_config() where it matters.
"""

import numpy as np
import pytest
from format_testutil import small_config, write_bare
from nanoqwen_format import write_synthetic
from nanoqwen_format.synthetic import write_hf_checkpoint


@pytest.fixture(scope="session")
def hf_untied(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("hf_untied"), small_config(), seed=11)


@pytest.fixture(scope="session")
def hf_tied_sharded(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("hf_tied"), small_config(tie_word_embeddings=True),
                               seed=12, shards=3)


@pytest.fixture(scope="session")
def synthetic_file(tmp_path_factory):
    """A valid small .nanoqwen (untied, the real tokenizer)."""
    path = tmp_path_factory.mktemp("syn") / "small.nanoqwen"
    write_synthetic(path, small_config(), seed=int(np.random.default_rng().integers(1 << 30)))
    return path


@pytest.fixture(scope="session")
def bare_file(tmp_path_factory):
    """2 layers, vocab 256, untied: the file malformation tests copy and damage."""
    return write_bare(tmp_path_factory.mktemp("bare") / "bare.nanoqwen", small_config(vocab_size=256))
