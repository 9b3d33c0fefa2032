"""`nanoqwen-cli serve`: the OpenAI-compatible HTTP server (app.py) under uvicorn.

The socket is bound here, before the model loads, so that the address is known (and printed) at once,
`--port 0` picks a free port, and a port already taken fails before minutes of loading. The model loads on
a thread while uvicorn already answers (/health: 503 until it is ready).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
import threading

import click

from nanoqwen_cli import session
from nanoqwen_cli.errors import CliError
from nanoqwen_cli.options import (
    decode_activations_option,
    lm_head_dtype_option,
    model_options,
    prefill_weights_option,
)

API_KEY_ENV = "NANOQWEN_API_KEY"


@click.command(short_help="Serve the model over HTTP with OpenAI's API.")
@model_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; 0.0.0.0 exposes the server to the network.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="TCP port (0: any free port; the one taken is printed).")
@click.option("--served-model-name", multiple=True,
              help="Name(s) clients put in `model` (repeatable). Default: the --model argument.")
@click.option("--api-key", envvar=API_KEY_ENV, default=None, show_envvar=True,
              help="Require `Authorization: Bearer KEY` on /v1 routes.")
@click.option("--max-batch", type=click.IntRange(min=1), default=64, show_default=True,
              help="Sequences decoded together in one step.")
@click.option("--max-queue", type=click.IntRange(min=1), default=256, show_default=True,
              help="Requests that may wait for a batch slot; beyond it a request gets 429.")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=512, show_default=True,
              help="Prompt tokens prefilled per step while other requests decode (bounds their stall).")
@click.option("--prefill-chunk-idle", type=click.IntRange(min=1), default=None,
              help="Prompt tokens prefilled per step while no request decodes (a lone prompt's time to "
                   "first token). Default: 8192 on the GPU, --prefill-chunk on the CPU.")
@click.option("--kv-pages", type=click.IntRange(min=1), default=None,
              help="KV cache pages (16 tokens each) shared by all sequences. Default: the engine's choice.")
@prefill_weights_option
@decode_activations_option
@lm_head_dtype_option
@click.option("--max-body-bytes", type=click.IntRange(min=1024), default=8 * 2**20, show_default=True,
              help="Largest request body accepted (413 beyond).")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="On SIGTERM / Ctrl-C, seconds to let requests in flight finish before they are cut.")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              default="info", show_default=True)
@click.option("--access-log/--no-access-log", default=True, show_default=True, help="One line per request.")
def serve(model, device, max_context, host, port, served_model_name, api_key, max_batch, max_queue,
          prefill_chunk, prefill_chunk_idle, kv_pages, prefill_weights, decode_activations, lm_head_dtype, max_body_bytes, drain_timeout, log_level,
          access_log):
    """Serve MODEL with OpenAI's HTTP API: /v1/chat/completions, /v1/completions (`suffix` for
    fill-in-the-middle), /v1/models, /health, /metrics (docs/SERVER.md).

    Concurrent requests are decoded together in one batch. SIGTERM or Ctrl-C stops accepting connections,
    lets the requests in flight finish (at most --drain-timeout seconds) and exits 0.

    \b
    Examples:
        nanoqwen-cli serve                      # Qwen2.5-Coder-7B-Instruct on 127.0.0.1:8000
        nanoqwen-cli serve --model tiny.nanoqwen --device cpu --port 0
        curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
             -d '{"model": "Qwen/Qwen2.5-Coder-7B-Instruct", "messages": [{"role": "user", "content": "hi"}]}'
    """
    import uvicorn

    from nanoqwen_cli.server.app import ServerConfig, ServerState, create_app

    if api_key is not None and not api_key.strip():
        raise CliError(f"--api-key / {API_KEY_ENV} is empty")
    engine_kwargs = {"max_batch": max_batch, "max_queue": max_queue, "prefill_chunk": prefill_chunk}
    if prefill_chunk_idle is not None:
        engine_kwargs["prefill_chunk_idle"] = prefill_chunk_idle
    if kv_pages is not None:
        engine_kwargs["kv_pages"] = kv_pages
    if prefill_weights is not None:
        engine_kwargs["prefill_weights"] = prefill_weights
    if decode_activations is not None:
        engine_kwargs["decode_activations"] = decode_activations
    if lm_head_dtype is not None:
        engine_kwargs["lm_head_dtype"] = lm_head_dtype
    if device == "cuda":
        session.require_gpu()

    sock = _bind(host, port)
    config = ServerConfig(served_names=list(served_model_name) or [model], api_key=api_key,
                          max_body_bytes=max_body_bytes, drain_timeout=drain_timeout)

    def load():
        progress = sys.stderr.isatty()
        return session.load(model, device, max_context, progress=progress, **engine_kwargs).engine

    state = ServerState(config, load)
    # The app ends requests at the drain timeout itself (ServerState.watch_for_shutdown), each with an
    # error event; uvicorn's own timeout, later, only cuts connections that still do not close.
    server = _graceful_server(uvicorn.Config(create_app(state), log_level=log_level, access_log=access_log,
                                            timeout_graceful_shutdown=drain_timeout + 10, lifespan="on"))
    state.stopping = lambda: server.should_exit

    def load_failed(exc: BaseException) -> None:
        server.should_exit = True

    state.on_load_failed = load_failed
    bound_host, bound_port = sock.getsockname()[:2]
    click.echo(f"nanoqwen-cli serve: {model} ({device}) on http://{_url_host(bound_host)}:{bound_port} "
               "(loading; GET /health answers 200 when ready)", err=True)
    server.run(sockets=[sock])
    if state.load_error is not None:
        raise state.load_error


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise CliError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise CliError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _graceful_server(config):
    """A uvicorn.Server whose SIGINT/SIGTERM handling ends in exit status 0 after the drain."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn's own version re-raises the captured signal once it has shut down, so the process
            # would end with SIGTERM's status; a server that drained cleanly exits 0 instead. The first
            # SIGINT/SIGTERM starts the graceful shutdown, a second SIGINT forces it (handle_exit).
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in originals.items():
                    signal.signal(sig, handler)

    return Server(config)
