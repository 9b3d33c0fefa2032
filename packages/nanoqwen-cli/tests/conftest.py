"""Fixtures for the CLI's CliRunner tests: a tiny synthetic model on the CPU reference backend.

Every test gets its own empty model cache and an offline, empty Hugging Face home, so nothing here can
reach the network or reuse a file another test converted. Tests that draw random numbers take them from
the `rng` fixture: its seed is printed when the test fails, and `pytest --seed N` replays it.
"""

from __future__ import annotations

import functools

import pytest
from click.testing import CliRunner
from nanoqwen_cli.main import cli
from nanoqwen_engine.testing import pytest_addoption, pytest_runtest_makereport, rng, seed  # noqa: F401


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from nanoqwen_format.synthetic import tiny_config, write_synthetic

    path = tmp_path_factory.mktemp("models") / "tiny.nanoqwen"
    write_synthetic(path, tiny_config(), seed=0)
    return path


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    """One `nanoqwen-cli serve` process for the server tests that need no special flags (its load costs
    seconds): the tiny model under two names, batches of up to 32 sequences. Stopped with SIGTERM at the
    end, which must exit 0."""
    from server_process import ServeProcess

    proc = ServeProcess(tiny_model, tmp_path_factory.mktemp("serve"), "--served-model-name", "tiny",
                        "--served-model-name", "tiny-alias", "--max-batch", "32")
    try:
        proc.health_statuses()
        yield proc
    finally:
        rc = proc.stop()
    assert rc == 0, proc.output()


@pytest.fixture(scope="session")
def tiny_engine(tiny_model):
    """The same model loaded directly through the engine: what the CLI's output is checked against."""
    from nanoqwen_engine import Engine

    return Engine.load(tiny_model, device="cpu", progress=False)  # a separate instance from the CLI's


_LOADED: dict = {}


@pytest.fixture(autouse=True)
def reuse_loaded_engines(monkeypatch):
    """Load each (file, device, max_context) once per test session.

    Parsing the 7 MB tokenizer.json makes every Engine.load cost ~1 s, which a few dozen CliRunner
    invocations cannot afford in CI; each request frees its pages, so an engine can serve many tests.
    The subprocess tests (tests/test_cli_*.py at the root) load for real every time.
    """
    from nanoqwen_engine import Engine

    original = Engine.load

    @functools.wraps(original)
    def load(path_or_hf_id, device="cuda", max_context=None, progress=True, **kwargs):
        key = (str(path_or_hf_id), device, max_context, tuple(sorted(kwargs.items())))
        if key not in _LOADED:
            _LOADED[key] = original(
                path_or_hf_id, device=device, max_context=max_context, progress=progress, **kwargs
            )
        return _LOADED[key]

    monkeypatch.setattr(Engine, "load", load)


@pytest.fixture(autouse=True)
def isolated_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path / "nanoqwen-cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("NANOQWEN_MODEL", raising=False)
    monkeypatch.delenv("NANOQWEN_DEBUG", raising=False)


@pytest.fixture
def invoke():
    """invoke(args, input=None) -> click Result, with stdout and stderr kept apart."""
    runner = CliRunner()

    def _invoke(args, input=None):
        return runner.invoke(cli, [str(a) for a in args], input=input)

    return _invoke


@pytest.fixture
def engine_loads(monkeypatch):
    """The keyword arguments of every Engine.load, in order (the loads themselves go on: the session's cached
    ones). With `.stop` set, the load raises instead (serve would otherwise serve)."""
    from nanoqwen_engine import Engine
    from nanoqwen_engine.errors import InvalidRequestError

    class Calls(list):
        stop = False

    calls = Calls()
    load = Engine.load

    def spy(path, *args, **kwargs):
        calls.append(kwargs)
        if calls.stop:
            raise InvalidRequestError("stopped by the test after Engine.load was called")
        return load(path, *args, **kwargs)

    monkeypatch.setattr(Engine, "load", spy)
    return calls
