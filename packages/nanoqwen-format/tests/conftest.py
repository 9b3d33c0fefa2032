"""Shared fixtures: the seeded random source, and small synthetic Qwen2 checkpoints and .nanoqwen files
built once per session.

Randomness: every test that draws random numbers takes `rng` (or `seed`). Each test draws its own seed,
and a failing test's report carries a "seed" section with it; `pytest --seed N` gives every test (and the
session's shared files) seed N, which replays that failure. The session seed is printed in the header.

Most tests use a 2048-entry vocabulary: the format does not care about vocab size, and the real 152064
would make every checkpoint ~160 MB. test_synthetic.py uses the full tiny_config() where it matters.
"""

import secrets

import numpy as np
import pytest
from format_testutil import small_config, write_bare
from nanoqwen_format import write_synthetic
from nanoqwen_format.synthetic import write_hf_checkpoint

SEED_KEY = pytest.StashKey[int]()
SESSION_SEED = pytest.StashKey[int]()
FUZZ_REPORTS = pytest.StashKey[list]()


def pytest_addoption(parser):
    try:
        parser.addoption("--seed", type=int, default=None,
                         help="seed for every test's random draws (replays a failure; default: fresh per test)")
    except ValueError:
        pass  # another package's conftest in the same run already added it; the meaning is the same


def pytest_configure(config):
    fixed = config.getoption("--seed")
    config.stash[SESSION_SEED] = fixed if fixed is not None else secrets.randbits(32)
    config.stash[FUZZ_REPORTS] = []


def pytest_report_header(config):
    return f"nanoqwen-format: session seed {config.stash[SESSION_SEED]} (replay with --seed)"


@pytest.fixture(scope="session")
def session_seed(request) -> int:
    """The seed of the files built once per session (printed in the header)."""
    return request.config.stash[SESSION_SEED]


@pytest.fixture
def seed(request) -> int:
    """This test's seed: --seed if given, else a fresh one; a failure's report shows it."""
    fixed = request.config.getoption("--seed")
    s = fixed if fixed is not None else secrets.randbits(32)
    request.node.stash[SEED_KEY] = s
    return s


@pytest.fixture
def rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        own = item.stash.get(SEED_KEY, None)
        lines = [f"session seed (shared files): {item.config.stash[SESSION_SEED]}"]
        if own is not None:
            lines.insert(0, f"this test's seed: {own} (replay: pytest --seed {own} {item.nodeid})")
        report.sections.append(("seed", "\n".join(lines)))


def pytest_terminal_summary(terminalreporter, config):
    for line in config.stash.get(FUZZ_REPORTS, []):
        terminalreporter.write_line(line)


@pytest.fixture
def fuzz_report(request):
    """Append a line to the run's summary (the reader fuzz reports how many cases it ran)."""
    return request.config.stash[FUZZ_REPORTS].append


@pytest.fixture(scope="session")
def hf_untied(tmp_path_factory, session_seed):
    return write_hf_checkpoint(tmp_path_factory.mktemp("hf_untied"), small_config(), seed=session_seed)


@pytest.fixture(scope="session")
def hf_tied_sharded(tmp_path_factory, session_seed):
    return write_hf_checkpoint(tmp_path_factory.mktemp("hf_tied"), small_config(tie_word_embeddings=True),
                               seed=session_seed + 1, shards=3)


@pytest.fixture(scope="session")
def synthetic_file(tmp_path_factory, session_seed):
    """A valid small .nanoqwen (untied, the real tokenizer)."""
    path = tmp_path_factory.mktemp("syn") / "small.nanoqwen"
    write_synthetic(path, small_config(), seed=session_seed)
    return path


@pytest.fixture(scope="session")
def bare_file(tmp_path_factory, session_seed):
    """2 layers, vocab 256, untied: the file malformation tests copy and damage."""
    return write_bare(tmp_path_factory.mktemp("bare") / "bare.nanoqwen", small_config(vocab_size=256),
                      np.random.default_rng(session_seed))
