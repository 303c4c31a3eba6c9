"""The ASGI application: routes requests to the API dialects; the factory granian calls."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from mlxgate import logs, prompts, serving, trace
from mlxgate._native import ErrorKind
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
    send_error,
    send_json,
)
from mlxgate.api.openai import OpenAIAPI
from mlxgate.api.pipeline import Services
from mlxgate.api.responses import ResponsesAPI
from mlxgate.api.responses.websocket import ResponsesWebSocket
from mlxgate.api.resumable import Resumable
from mlxgate.api.routing import Route
from mlxgate.api.service import ServiceAPI
from mlxgate.config import Config
from mlxgate.engine import GenerationEngine
from mlxgate.metrics import ModelsCollector
from mlxgate.registry import ModelRegistry
from mlxgate.served import ServedModel

log = logging.getLogger("mlxgate")

# Each dialect's routes; adding a dialect is one line here.
DIALECTS = (AnthropicAPI, OpenAIAPI, ResponsesAPI)


class App:
    """Routes by path suffix, so a base-URL prefix (`http://host/some/prefix`) works too.

    Each route has a dialect; every error on it is answered in that dialect's envelope. The
    request goes through the wrappers of api/middleware.py, stacked here.
    """

    def __init__(self, models: ModelRegistry, config: Config, drain: Drain | None = None) -> None:
        self.models = models
        self.config = config
        self.resumable = Resumable(config.resume_window) if config.resume_window > 0 else None
        services = Services(
            models=models,
            config=config,
            max_output_tokens=config.max_output_tokens,
            resumable=self.resumable,
        )
        apis = [api(services) for api in DIALECTS]
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
        # An app's own: a process may hold several apps.
        self.metrics_registry = CollectorRegistry()
        self.metrics_registry.register(ModelsCollector(models))
        self.routes: list[Route] = [
            *(route for api in apis for route in api.routes()),
            *(self.resumable.routes() if self.resumable is not None else []),
            *ServiceAPI(models, self.drain, self.metrics_registry).routes(),
        ]
        self.websocket = ResponsesWebSocket(
            next(api for api in apis if isinstance(api, ResponsesAPI)),
            self.guard,
            self.drain,
            self.metrics_registry,
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
        app = mw.Counters(app, self.metrics_registry)
        app = mw.RequestLog(app, self.models.default.name)
        app = mw.RequestId(app)
        app = mw.Cors(app, guard)
        app = mw.Routing(app, self.routes)
        app = mw.WebSockets(app, self.websocket)
        return mw.Lifespan(app, startup=self.drain.install, shutdown=self.stop_engine)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.asgi(scope, receive, send)

    @property
    def engine(self) -> GenerationEngine:
        """The default model's engine."""
        return self._default().engine

    @property
    def renderer(self) -> prompts.Renderer:
        return self._default().renderer

    def _default(self) -> ServedModel:
        served = self.models.default.served
        assert served is not None, "the default model is loaded at start-up and kept"
        return served

    def stop_engine(self) -> None:
        """Stop the engines once (the drain and the lifespan's shutdown both ask)."""
        if self._engine_stopped.acquire(blocking=False):
            self.models.stop()


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
    """The app with its default model (and any pinned ones) loaded."""
    import mlx.core as mx

    from mlxgate import blas

    started = time.monotonic()
    registry = serving.registry(config)
    served = registry.default.served
    assert served is not None
    others = [entry.name for entry in registry.entries.values() if entry.served is None]
    log.info(
        "mlxgate ready: model %s (context %s), %sdevice %s, BLAS %s, loaded in %.1fs. "
        "Point clients at http://%s:%d (ANTHROPIC_BASE_URL, or OPENAI_BASE_URL=.../v1)",
        served.name,
        served.context_length,
        f"also {', '.join(others)} (loaded when named), " if others else "",
        mx.default_device(),
        blas.blas_in_use(),
        time.monotonic() - started,
        config.host,
        config.port,
    )
    return App(registry, config, drain)


def create_app() -> Loading:
    """The ASGI app factory: granian calls it in its worker process."""
    config = Config.from_env()
    logs.configure(config.log_level, config.log_format)
    return Loading(config)
