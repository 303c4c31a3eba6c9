"""The ASGI application: routes requests to the API dialects; the factory granian calls."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, generate_latest

from mlxgate import chat, logs, trace
from mlxgate._native import Dialect, ErrorKind, Router, Vocab
from mlxgate.api.anthropic import AnthropicAPI
from mlxgate.api.drain import Drain
from mlxgate.api.errors import ApiError
from mlxgate.api.guard import Guard
from mlxgate.api.http import (
    BodyTooLarge,
    ClientGone,
    Message,
    Receive,
    Scope,
    Send,
    client_address,
    header,
    read_body,
    send_bytes,
    send_error,
    send_json,
)
from mlxgate.api.models import ModelNames
from mlxgate.api.openai import OpenAIAPI
from mlxgate.api.pipeline import Services
from mlxgate.api.responses import ResponsesAPI
from mlxgate.api.resumable import Resumable
from mlxgate.api.routing import Route
from mlxgate.config import Config
from mlxgate.engine import Engine, Generator, SamplingParams
from mlxgate.engine.drafter import check_vocabularies
from mlxgate.metrics import EngineCollector

log = logging.getLogger("mlxgate")

HTTP_REQUESTS = Counter(
    "mlxgate_http_requests_total", "HTTP requests by route and status", ["route", "status"]
)

# Each dialect's routes; adding a dialect is one line here.
DIALECTS = (AnthropicAPI, OpenAIAPI, ResponsesAPI)


class App:
    """Routes by path suffix, so a base-URL prefix (`http://host/some/prefix`) works too.

    Each route has a dialect; every error on it is answered in that dialect's envelope.
    """

    def __init__(
        self,
        engine: Generator,
        renderer: chat.Renderer,
        served: str,
        config: Config,
        drain: Drain | None = None,
    ) -> None:
        self.engine = engine
        self.renderer = renderer
        self.config = config
        self.models = ModelNames(
            served, config.model_aliases, strict=config.strict_models, model_arg=config.model
        )
        self.resumable = Resumable(config.resume_window) if config.resume_window > 0 else None
        services = Services(
            engine=engine,
            renderer=renderer,
            models=self.models,
            default_sampling=SamplingParams(config.temperature, config.top_p, config.top_k),
            config=config,
            max_output_tokens=config.max_output_tokens,
            resumable=self.resumable,
        )
        self.routes: list[Route] = [
            *(route for api in DIALECTS for route in api(services).routes()),
            *(self.resumable.routes() if self.resumable is not None else []),
            Route("GET", "/health", Dialect.OPENAI, self._health),
            Route("HEAD", "/health", Dialect.OPENAI, self._health),
            Route("GET", "/metrics", Dialect.OPENAI, self._metrics),
        ]
        self.guard = Guard(
            api_key=config.api_key,
            allowed_hosts=config.allowed_hosts,
            cors_origins=config.cors_origins,
            max_per_client=config.max_per_client,
            rate_limit=config.rate_limit,
        )
        self.drain = drain or Drain(config.drain_timeout, self.stop_engine)
        self.recorder = trace.Recorder(Path(config.record_trace)) if config.record_trace else None
        self._engine_stopped = threading.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path: str = scope["path"].rstrip("/") or "/"
        method: str = scope["method"]
        route = self._route(scope, method, path)
        dialect = route.dialect if route else _fallback_dialect(path)
        label = route.path if route and not route.prefix else "other"
        status = 0
        started = time.monotonic()
        streams = logs.OPENED.set([])
        request_id = f"req_{secrets.token_hex(12)}".encode()
        scope["mlxgate.request_id"] = request_id.decode()
        guard = self.guard

        async def send_tracked(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [
                    *message.get("headers", []),
                    (b"request-id", request_id),
                    (b"x-request-id", request_id),
                    *guard.cors_headers(scope),
                ]
            await send(message)

        try:
            guard.check(scope)
            if method == "OPTIONS" and header(scope, b"origin") is not None:
                # A browser's preflight from an allowed origin (check() refused the others).
                headers = guard.preflight_headers(scope)
                await send_tracked(
                    {"type": "http.response.start", "status": 204, "headers": headers}
                )
                await send_tracked({"type": "http.response.body", "body": b""})
                return
            if not path.endswith("/health") and not guard.authorized(scope):
                raise ApiError(
                    ErrorKind.AUTHENTICATION,
                    "invalid x-api-key or Authorization bearer token",
                    should_retry=False,
                    code="invalid_api_key",
                )
            if route is None:
                raise ApiError(
                    ErrorKind.NOT_FOUND, f"{method} {scope['path']} is not a route of this server"
                )
            body = b""
            if method == "POST":
                if self.drain.draining:
                    raise ApiError(
                        ErrorKind.UNAVAILABLE,
                        "the server is shutting down",
                        retry_after_s=int(self.config.drain_timeout) + 1,
                    )
                client = guard.client(scope)
                guard.take_token(client)
                body = await read_body(receive, self.config.max_body_bytes)
                counting = label.endswith("count_tokens")  # generates nothing: no slot
                session = None
                if self.recorder is not None and not counting:
                    session = trace.session_of(scope["headers"], client_address(scope))
                    self.recorder.started(session, route.path, body)
                self.drain.in_flight += 1
                try:
                    with contextlib.nullcontext() if counting else guard.slot(client):
                        await route.handler(scope, receive, send_tracked, body)
                finally:
                    self.drain.in_flight -= 1
                    if session is not None and self.recorder is not None:
                        self.recorder.ended(session)
            else:
                await route.handler(scope, receive, send_tracked, body)
        except ApiError as exc:
            await send_error(send_tracked, exc, dialect)
        except BodyTooLarge as exc:
            await send_error(send_tracked, ApiError(ErrorKind.REQUEST_TOO_LARGE, str(exc)), dialect)
        except ClientGone:
            pass
        except Exception:
            log.exception("unhandled error on %s %s", method, path)
            if status == 0:
                error = ApiError(
                    ErrorKind.INTERNAL, "internal server error (the server log has the details)"
                )
                await send_error(send_tracked, error, dialect)
        finally:
            HTTP_REQUESTS.labels(label, str(status or 499)).inc()
            fields = {
                "id": request_id.decode(),
                "method": method,
                "route": route.path if route else path,
                "dialect": repr(dialect).removeprefix("Dialect.").lower(),
                "model": self.models.served,
                "status": status,
                "duration_s": round(time.monotonic() - started, 4),
            }
            logs.request_ended(fields, logs.OPENED.get() or [])
            logs.OPENED.reset(streams)

    def _route(self, scope: Scope, method: str, path: str) -> Route | None:
        for route in self.routes:
            if route.method != method or (route.header and header(scope, route.header) is None):
                continue
            if route.matches(path):
                return route
        return None

    async def _health(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        if self.drain.draining:
            await send_json(send, 503, {"status": "draining", "model": self.models.served})
            return
        await send_json(send, 200, {"status": "ok", "model": self.models.served})

    def stop_engine(self) -> None:
        """Stop the engine once (the drain and the lifespan's shutdown both ask)."""
        if self._engine_stopped.acquire(blocking=False):
            self.engine.stop()

    async def _metrics(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        await send_bytes(send, 200, generate_latest(), CONTENT_TYPE_LATEST.encode())

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.drain.install()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.stop_engine()
                await send({"type": "lifespan.shutdown.complete"})
                return


def _fallback_dialect(path: str) -> Dialect:
    """The envelope for a path no route has: OpenAI's where the path looks like OpenAI's."""
    openai = any(word in path for word in ("completions", "embeddings", "/v1/models", "responses"))
    return Dialect.OPENAI if openai else Dialect.ANTHROPIC


class Loading:
    """The ASGI app granian serves: answers 503 while the model loads (`/health`: `loading`, so
    an orchestrator waits), then hands every request to the App. A model that fails to load
    stops the worker, and with it the server."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.app: App | None = None
        self.drain = Drain(config.drain_timeout, self._stop_engine)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            path = scope["path"]
            if path.rstrip("/").endswith("/health"):
                await send_json(send, 503, {"status": "loading"}, [(b"retry-after", b"2")])
                return
            error = ApiError(ErrorKind.UNAVAILABLE, "the model is loading", retry_after_s=2)
            await send_error(send, error, _fallback_dialect(path))

    def _load(self) -> None:
        try:
            self.app = build_app(self.config, self.drain)
        except BaseException:
            log.exception("the model could not be loaded")
            logging.shutdown()
            os._exit(1)

    def _stop_engine(self) -> None:
        if self.app is not None:
            self.app.stop_engine()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.drain.install()
                threading.Thread(target=self._load, name="mlxgate-load", daemon=True).start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self._stop_engine()
                await send({"type": "lifespan.shutdown.complete"})
                return


def build_app(config: Config, drain: Drain | None = None) -> App:
    from mlxgate import blas, models

    started = time.monotonic()
    loaded = models.load(
        config.model,
        trust_remote_code=config.trust_remote_code,
        context_length=config.context_length,
        rope_scaling=config.rope_scaling,
    )
    tokenizer = loaded.tokenizer
    vocab = Vocab.from_token_strings(
        tokenizer.token_strings(), tokenizer.vocab_kind, sorted(tokenizer.special_ids)
    )
    renderer = chat.Renderer(
        tokenizer,
        tool_format=None if config.tool_format == "auto" else config.tool_format,
        reasoning_format=None if config.reasoning_format == "auto" else config.reasoning_format,
    )
    draft = None
    if config.draft_model is not None:
        draft = models.load(
            config.draft_model,
            trust_remote_code=config.trust_remote_code,
            context_length=loaded.context_length,
            rope_scaling=config.rope_scaling,
        )
        check_vocabularies(tokenizer.token_strings(), draft.tokenizer.token_strings())
        log.info(
            "draft model %s: %s, %s",
            draft.name,
            models.architecture(draft.model),
            models.precision(draft.model),
        )
    engine = Engine(
        loaded,
        Router(vocab),
        config.engine,
        end_ids=renderer.eos_ids,
        draft_model=draft.model if draft else None,
    )
    layout = engine.layout
    log.info(
        "model %s: %s, %s, %s, context %s; the prefix cache reuses %s",
        loaded.name,
        models.architecture(loaded.model),
        layout.describe(),
        models.precision(loaded.model),
        loaded.describe_context(),
        layout.reuse(),
    )
    engine.start()
    REGISTRY.register(EngineCollector(engine))
    import mlx.core as mx

    log.info(
        "mlxgate ready: model %s (context %s, %s), tool calls %s, reasoning %s, device %s, "
        "BLAS %s, loaded in %.1fs. "
        "Point clients at http://%s:%d (ANTHROPIC_BASE_URL, or OPENAI_BASE_URL=.../v1)",
        loaded.name,
        loaded.describe_context(),
        loaded.source,
        _chosen(renderer.format.tool_format.NAME, config.tool_format),
        _chosen(renderer.format.reasoning.name, config.reasoning_format),
        mx.default_device(),
        blas.blas_in_use(),
        time.monotonic() - started,
        config.host,
        config.port,
    )
    return App(engine, renderer, loaded.name, config, drain)


def _chosen(name: str, setting: str) -> str:
    return f"{name} ({'detected' if setting == 'auto' else 'set'})"


def create_app() -> Loading:
    """The ASGI app factory: granian calls it in its worker process."""
    config = Config.from_env()
    logs.configure(config.log_level, config.log_format)
    return Loading(config)
