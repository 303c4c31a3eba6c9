"""The ASGI application: routes requests to the API dialects; the factory granian calls."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from mlxgate import chat, logs, trace
from mlxgate._native import Dialect, ErrorKind, Router, Vocab
from mlxgate.api import middleware as mw
from mlxgate.api.anthropic import AnthropicAPI
from mlxgate.api.drain import Drain
from mlxgate.api.errors import ApiError
from mlxgate.api.guard import Guard
from mlxgate.api.http import (
    Receive,
    Scope,
    Send,
    refuse_websocket,
    send_bytes,
    send_error,
    send_json,
)
from mlxgate.api.models import ModelNames
from mlxgate.api.openai import OpenAIAPI
from mlxgate.api.pipeline import Services
from mlxgate.api.responses import ResponsesAPI
from mlxgate.api.responses.websocket import ResponsesWebSocket
from mlxgate.api.resumable import Resumable
from mlxgate.api.routing import Route
from mlxgate.config import Config
from mlxgate.engine import Engine, Generator, SamplingParams
from mlxgate.engine.drafter import check_vocabularies
from mlxgate.metrics import EngineCollector

log = logging.getLogger("mlxgate")

# Each dialect's routes; adding a dialect is one line here.
DIALECTS = (AnthropicAPI, OpenAIAPI, ResponsesAPI)


class App:
    """Routes by path suffix, so a base-URL prefix (`http://host/some/prefix`) works too.

    Each route has a dialect; every error on it is answered in that dialect's envelope. The
    request goes through the wrappers of api/middleware.py, stacked here.
    """

    def __init__(
        self,
        engine: Generator,
        renderer: chat.Renderer,
        served: str,
        config: Config,
        drain: Drain | None = None,
        metrics: Collector | None = None,
    ) -> None:
        """`metrics`: what /metrics shows of the engine, besides the app's own counters."""
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
        apis = [api(services) for api in DIALECTS]
        self.routes: list[Route] = [
            *(route for api in apis for route in api.routes()),
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
        self.registry = CollectorRegistry()  # an app's own: a process may hold several apps
        if metrics is not None:
            self.registry.register(metrics)
        self.websocket = ResponsesWebSocket(
            next(api for api in apis if isinstance(api, ResponsesAPI)),
            self.guard,
            self.drain,
            self.registry,
            max_message_bytes=config.max_body_bytes,
        )
        self.asgi = self._stack()

    def _stack(self) -> mw.ASGIApp:
        """The wrappers, innermost first."""
        guard = self.guard

        def generation(app: mw.ASGIApp) -> mw.ASGIApp:
            app = mw.Slots(app, guard)
            if self.recorder is not None:
                app = mw.Trace(app, self.recorder)
            app = mw.BodyLimit(app, self.config.max_body_bytes)
            app = mw.RateLimit(app, guard)
            return mw.DrainGate(app, self.drain)

        app: mw.ASGIApp = mw.Posts(mw.dispatch, generation)
        app = mw.NotFound(app)
        app = mw.Auth(app, guard)
        app = mw.Preflight(app, guard)
        app = mw.HostGuard(app, guard)
        app = mw.Envelopes(app)
        app = mw.Counters(app, self.registry)
        app = mw.RequestLog(app, self.models.served)
        app = mw.RequestId(app)
        app = mw.Cors(app, guard)
        app = mw.Routing(app, self.routes)
        app = mw.WebSockets(app, self.websocket)
        return mw.Lifespan(app, startup=self.drain.install, shutdown=self.stop_engine)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.asgi(scope, receive, send)

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
        body = generate_latest(self.registry)
        await send_bytes(send, 200, body, CONTENT_TYPE_LATEST.encode())


class Loading:
    """The ASGI app granian serves: answers 503 while the model loads (`/health`: `loading`, so
    an orchestrator waits), then hands every request to the App. A model that fails to load
    stops the worker, and with it the server."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.app: App | None = None
        self.drain = Drain(config.drain_timeout, self._stop_engine)
        self.asgi = mw.Lifespan(self._serve, startup=self._start, shutdown=self._stop_engine)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.asgi(scope, receive, send)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.app is not None:
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path.rstrip("/").endswith("/health"):
            await send_json(send, 503, {"status": "loading"}, [(b"retry-after", b"2")])
            return
        error = ApiError(ErrorKind.UNAVAILABLE, "the model is loading", retry_after_s=2)
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            await refuse_websocket(scope, send, error, mw.fallback_dialect(path))
            return
        await send_error(send, error, mw.fallback_dialect(path))

    def _start(self) -> None:
        self.drain.install()
        threading.Thread(target=self._load, name="mlxgate-load", daemon=True).start()

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


def build_app(config: Config, drain: Drain | None = None) -> App:
    from mlxgate import blas, models

    started = time.monotonic()
    loaded = models.load(
        config.model,
        trust_remote_code=config.trust_remote_code,
        context_length=config.context_length,
        rope_scaling=config.rope_scaling,
        weights=config.weights,
        cpu_kernels=not config.no_cpu_kernels,
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
            weights=config.weights,
            cpu_kernels=not config.no_cpu_kernels,
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
    import mlx.core as mx

    log.info(
        "mlxgate ready: model %s (context %s, %s), tool calls %s, reasoning %s, device %s, "
        "BLAS %s, kernels: %s, loaded in %.1fs. "
        "Point clients at http://%s:%d (ANTHROPIC_BASE_URL, or OPENAI_BASE_URL=.../v1)",
        loaded.name,
        loaded.describe_context(),
        loaded.source,
        _chosen(renderer.format.tool_format.NAME, config.tool_format),
        _chosen(renderer.format.reasoning.name, config.reasoning_format),
        mx.default_device(),
        blas.blas_in_use(),
        loaded.kernels,
        time.monotonic() - started,
        config.host,
        config.port,
    )
    return App(engine, renderer, loaded.name, config, drain, EngineCollector(engine))


def _chosen(name: str, setting: str) -> str:
    return f"{name} ({'detected' if setting == 'auto' else 'set'})"


def create_app() -> Loading:
    """The ASGI app factory: granian calls it in its worker process."""
    config = Config.from_env()
    logs.configure(config.log_level, config.log_format)
    return Loading(config)
