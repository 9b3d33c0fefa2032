"""The HTTP routes (Starlette): OpenAI's completions and chat completions over the batched engine.

    POST /v1/chat/completions   messages through the model's chat template
    POST /v1/completions        raw text; with `suffix`, Qwen2.5-Coder's fill-in-the-middle prompt
    GET  /v1/models             the served model name(s)
    GET  /health                200 once the model is loaded, 503 while loading or draining
    GET  /metrics               Prometheus text (metrics.py)

Each generation request is one `Engine.submit`; the engine's thread batches every running request into
one decode step, and this event loop only moves events from the engine to the sockets. A request ends
when its last event is sent, or earlier when its client goes away: the handle is cancelled (its KV pages
freed at the engine's next step boundary) whether the answer was streamed or not.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from anyio import to_thread
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from nanoqwen_cli.server import protocol
from nanoqwen_cli.server.metrics import Metrics
from nanoqwen_cli.server.protocol import FINISH_REASONS, Parsed, ProtocolError, Shape, sse

log = logging.getLogger("uvicorn.error")  # uvicorn's own logger, so the server's lines share its format

# The routes the metrics label by path; anything else (404s) is counted as "other", so that a scan of
# random URLs cannot grow the label set without bound.
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


@dataclass
class ServerConfig:
    served_names: list[str]  # model names a request may use; the first is the one /v1/models lists first
    api_key: str | None = None  # Bearer token the /v1 routes require (None: open)
    max_body_bytes: int = 8 * 2**20
    drain_timeout: float = 30.0  # seconds requests in flight may run on after a shutdown signal


@dataclass
class ServerState:
    """What the routes share: the engine once it is loaded, or why it is not."""

    config: ServerConfig
    load: Callable[[], object]  # -> a loaded nanoqwen_engine.Engine (runs on a loader thread)
    on_load_failed: Callable[[BaseException], None] = lambda exc: None
    stopping: Callable[[], bool] = lambda: False  # True once the process was asked to shut down
    engine: object | None = None
    load_error: BaseException | None = None
    draining: bool = False
    in_flight: set = field(default_factory=set)  # RequestHandles not yet finished
    metrics: Metrics = field(init=False)

    def __post_init__(self):
        self.metrics = Metrics(self.engine_stats)

    def engine_stats(self) -> dict | None:
        return None if self.engine is None else self.engine.stats()

    def start_loading(self) -> None:
        """Load on a thread, so that /health answers 503 (and not a refused connection) meanwhile."""
        def run():
            try:
                self.engine = self.load()
                log.info("model loaded; serving %s", ", ".join(self.config.served_names))
            except BaseException as exc:  # noqa: BLE001 - reported by the serve command, which exits 1
                self.load_error = exc
                self.on_load_failed(exc)

        threading.Thread(target=run, name="nanoqwen-load", daemon=True).start()

    async def watch_for_shutdown(self) -> None:
        """Once a shutdown signal arrives: refuse new requests (503), give those in flight
        config.drain_timeout seconds, then cancel the rest, so that each ends with a clean error event
        instead of a connection cut by the server's own, later, timeout."""
        while not self.stopping():
            await asyncio.sleep(0.1)
        self.draining = True
        deadline = time.monotonic() + self.config.drain_timeout
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.in_flight:
            log.warning("drain timeout: cancelling %d request(s) still running", len(self.in_flight))
            for handle in list(self.in_flight):
                handle.cancel()

    def ready_engine(self):
        if self.draining:
            raise ProtocolError(503, "the server is shutting down", type="service_unavailable",
                                code="shutting_down")
        if self.engine is None:
            raise ProtocolError(503, "the model is still loading; retry when GET /health answers 200",
                                type="service_unavailable", code="model_loading", headers={"Retry-After": "5"})
        return self.engine

    def model_name(self, asked: str | None) -> str:
        if asked is None:
            return self.config.served_names[0]
        if asked not in self.config.served_names:
            raise ProtocolError(404, f"The model `{asked}` does not exist; this server serves "
                                     f"{', '.join(self.config.served_names)}",
                                param="model", code="model_not_found")
        return asked


def engine_error(exc: Exception, prompt_param: str | None) -> ProtocolError:
    """The engine's refusal of a request at submit, as the HTTP error a client expects."""
    name = type(exc).__name__
    if name == "PromptTooLongError":
        return protocol.bad_request(str(exc), param=prompt_param, code="context_length_exceeded")
    if name in ("InvalidRequestError", "TemplateError"):
        return protocol.bad_request(str(exc), param=prompt_param)
    if name == "KVPagesExhaustedError":  # at submit: this request could never fit the whole page pool
        return protocol.bad_request(str(exc), param="max_tokens", code="context_length_exceeded")
    if name == "QueueFullError":
        return ProtocolError(429, f"the server is busy: {exc}", type="rate_limit_error", code="queue_full",
                             headers={"Retry-After": "1"})
    if name == "EngineClosedError":
        return ProtocolError(503, "the server is shutting down", type="service_unavailable",
                             code="shutting_down")
    return ProtocolError(500, f"{name}: {exc}", type="server_error")


# -- ASGI middleware (outermost first): body size limit, then per-path counters --

class HttpMiddleware:
    """An ASGI middleware over the HTTP requests (`http(...)`); every other scope (the lifespan) passes
    through untouched."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        return await self.http(scope, receive, send)

    async def http(self, scope, receive, send):
        raise NotImplementedError


class BodyLimit(HttpMiddleware):
    """413 for a body over the limit, before the application reads any of it.

    The body is buffered here (up to the limit) and handed on whole; after it, `receive` is the server's
    own again, so an application waiting on it still sees the client's disconnect.
    """

    @property
    def limit(self) -> int:
        return self.state.config.max_body_bytes

    async def http(self, scope, receive, send):
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._too_large(send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left while sending
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._too_large(send)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send):
        err = ProtocolError(413, f"the request body is larger than the server's limit of {self.limit} bytes",
                            code="request_too_large")
        payload = json.dumps(err.body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


class CountRequests(HttpMiddleware):
    """nanoqwen_http_requests_total{path, status}: every HTTP answer, by route (unknown paths as "other")."""

    async def http(self, scope, receive, send):
        path = scope["path"] if scope["path"] in ROUTES else "other"
        counter = self.state.metrics.http_requests

        async def counted(message):
            if message["type"] == "http.response.start":
                counter.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


# -- the application --

def create_app(state: ServerState) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette):
        state.start_loading()
        watcher = asyncio.create_task(state.watch_for_shutdown())
        yield
        watcher.cancel()
        state.draining = True
        if state.engine is not None:
            state.engine.close()

    def v1(handler):
        """The /v1 routes require the API key when one is set (/health and /metrics stay open to probes)."""
        async def checked(request: Request):
            _authorize(state, request)
            return await handler(request)

        return checked

    async def chat_completions(request: Request):
        return await _generate(state, request, protocol.parse_chat, chat=True)

    async def completions(request: Request):
        return await _generate(state, request, protocol.parse_completion, chat=False)

    async def models(request: Request):
        extra = {} if state.engine is None else {"max_model_len": state.engine.max_context}
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "nanoqwen", **extra}
                for name in state.config.served_names]
        return JSONResponse({"object": "list", "data": data})

    async def health(request: Request):
        state.ready_engine()
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request):
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    routes = [
        Route("/v1/chat/completions", v1(chat_completions), methods=["POST"]),
        Route("/v1/completions", v1(completions), methods=["POST"]),
        Route("/v1/models", v1(models), methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    handlers = {ProtocolError: _protocol_error, HTTPException: _http_error, Exception: _unexpected}
    # Outermost first: a body over the limit never reaches the routes; every answer is counted.
    middleware = [Middleware(BodyLimit, state=state), Middleware(CountRequests, state=state)]
    return Starlette(routes=routes, middleware=middleware, exception_handlers=handlers, lifespan=lifespan)


def _authorize(state: ServerState, request: Request) -> None:
    key = state.config.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # compare_digest: the time taken does not depend on how much of the key a guess got right.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise ProtocolError(401, "Incorrect API key provided (Authorization: Bearer <key>)",
                            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


async def _protocol_error(request: Request, exc: ProtocolError):
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: HTTPException):
    """Starlette's own 404 (no such route) and 405 (wrong method), in OpenAI's shape."""
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    body = protocol.error_body(f"{request.method} {request.url.path}: {exc.detail}", kind)
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _unexpected(request: Request, exc: Exception):
    log.error("unexpected error in %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse(protocol.error_body(f"internal error: {type(exc).__name__}", "server_error"),
                        status_code=500)


async def _generate(state: ServerState, request: Request, parse: Callable[[object], Parsed], chat: bool):
    t0 = time.perf_counter()
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise protocol.bad_request(f"the request body is not valid JSON: {e}") from None
    parsed = parse(body)
    model = state.model_name(parsed.model)
    engine = state.ready_engine()
    params = protocol.sampling_params(parsed.sampling)
    handle = await to_thread.run_sync(_submit, engine, parsed, params)
    state.in_flight.add(handle)
    state.metrics.prompt_tokens.inc(handle.prompt_tokens)
    shape = Shape.for_endpoint(chat, model)
    out = _Outcome()
    events = _events(state, handle, t0, out)
    if parsed.stream:
        return _EventStream(_stream(state, events, out, handle, shape, parsed.include_usage),
                            release=lambda: _release(state, handle))
    return JSONResponse(await _collect(state, request, events, out, handle, shape))


class _EventStream(StreamingResponse):
    """The SSE response. `release` runs however sending ends: a client that disconnects before the
    first chunk cancels the stream before its generator ever starts, so the generator's own cleanup
    would not run and the request would decode on for nobody."""

    def __init__(self, body, release: Callable[[], None]):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._release = release

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def _release(state: ServerState, handle) -> None:
    """The request is over for the server: cancel it (a no-op once it finished), stop tracking it."""
    handle.cancel()
    state.in_flight.discard(handle)


def _submit(engine, parsed: Parsed, params):
    """Engine.submit (on a worker thread: it tokenizes the prompt), then the context check.

    A client that names max_tokens gets a 400 when prompt + max_tokens cannot fit, as OpenAI answers (the
    request, just queued, is cancelled: the prompt's length is known only once the engine tokenized it);
    a client that does not gets what the context has room for (finish_reason "length" there).
    """
    from nanoqwen_engine import NanoqwenError

    try:
        handle = engine.submit(parsed.prompt, params)
    except NanoqwenError as e:
        raise engine_error(e, parsed.prompt_param) from None
    if parsed.max_tokens_given and handle.prompt_tokens + params.max_tokens > engine.max_context:
        handle.cancel()
        raise protocol.bad_request(
            f"This model's maximum context length is {engine.max_context} tokens; the request asks for "
            f"{handle.prompt_tokens + params.max_tokens} ({handle.prompt_tokens} in the prompt, "
            f"{params.max_tokens} to generate)", param="max_tokens", code="context_length_exceeded")
    return handle


@dataclass
class _Outcome:
    completion_tokens: int = 0
    finish_reason: str | None = None  # the engine's
    error: Exception | None = None


async def _events(state: ServerState, handle, t0: float, out: _Outcome) -> AsyncIterator[str]:
    """The engine's events as text deltas, counted into `out`, with the metrics of each token.

    An engine error ends the iteration with out.error set. Whatever ends it, the handle is cancelled
    (a no-op once finished) and the request counted once under its finish reason.
    """
    from nanoqwen_engine import NanoqwenError

    m = state.metrics
    last = t0
    try:
        async for ev in handle:
            if ev.finish_reason is not None:
                out.finish_reason = ev.finish_reason
            if ev.finish_reason != "cancelled":  # a cancelled request's last event carries no token
                now = time.perf_counter()
                (m.itl if out.completion_tokens else m.ttft).observe(now - last)
                last = now
                out.completion_tokens += 1
                m.generation_tokens.inc()
            yield ev.text
        m.duration.observe(last - t0)
    except NanoqwenError as e:
        out.error = e
    finally:
        _release(state, handle)
        reason = "error" if out.error else out.finish_reason or "cancelled"
        m.finished.labels(reason).inc()


def _ended(out: _Outcome, state: ServerState) -> ProtocolError | None:
    """The error to report when the request did not finish on its own (engine error, server cancel)."""
    if out.error is not None:
        return engine_error(out.error, None)
    if out.finish_reason not in FINISH_REASONS:
        why = "the server is shutting down and the drain timeout passed" if state.draining else "cancelled"
        return ProtocolError(503, f"the request was ended before it finished: {why}",
                             type="service_unavailable", code="cancelled")
    return None


async def _stream(state: ServerState, events, out: _Outcome, handle, shape: Shape,
                  include_usage: bool) -> AsyncIterator[bytes]:
    """Server-sent events: the chunks, a final one with the finish reason, the usage chunk if asked,
    then `data: [DONE]`. Starlette cancels this generator when the client disconnects; closing `events`
    then cancels the request."""
    try:
        if shape.chat:
            yield sse(shape.chunk(None, role=True, include_usage=include_usage))
        async for text in events:
            if text:
                yield sse(shape.chunk(text, include_usage=include_usage))
        err = _ended(out, state)
        if err is not None:
            yield sse(err.body())
        else:
            yield sse(shape.chunk(None, FINISH_REASONS[out.finish_reason], include_usage=include_usage))
            if include_usage:
                yield sse(shape.usage_chunk(protocol.usage(handle.prompt_tokens, out.completion_tokens)))
        yield protocol.DONE
    finally:
        await events.aclose()


async def _collect(state: ServerState, request: Request, events, out: _Outcome, handle, shape: Shape) -> dict:
    """The whole answer; a task watches the connection meanwhile and cancels the request if it drops."""
    watcher = asyncio.ensure_future(_cancel_on_disconnect(request, handle))
    parts: list[str] = []
    try:
        async for text in events:
            parts.append(text)
    finally:
        watcher.cancel()
        await events.aclose()
    err = _ended(out, state)
    if err is not None:
        raise err
    use = protocol.usage(handle.prompt_tokens, out.completion_tokens)
    return shape.response("".join(parts), FINISH_REASONS[out.finish_reason], use)


async def _cancel_on_disconnect(request: Request, handle) -> None:
    # The body is read, so the next message the server sends this request is its disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
    handle.cancel()
