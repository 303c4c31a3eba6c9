"""The ASGI application: routes requests to the API dialects; the factory granian calls."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from mlxgate import chat, logs, ranks, trace
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
from mlxgate.api.openai import OpenAIAPI
from mlxgate.api.pipeline import Services
from mlxgate.api.responses import ResponsesAPI
from mlxgate.api.responses.websocket import ResponsesWebSocket
from mlxgate.api.resumable import Resumable
from mlxgate.api.routing import Route, path_tail
from mlxgate.config import Config
from mlxgate.engine import Engine, Generator, SamplingParams
from mlxgate.engine.drafter import check_vocabularies
from mlxgate.engine.lockstep import RankGroup
from mlxgate.metrics import EngineCollector, ModelsCollector
from mlxgate.registry import (
    Configured,
    ModelRegistry,
    ModelSpec,
    ServedModel,
    Turns,
    default_memory_budget,
    read_specs,
)

if TYPE_CHECKING:
    import mlx.nn as nn

    from mlxgate.models import LoadedModel

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
        self.routes: list[Route] = [
            *(route for api in apis for route in api.routes()),
            *(self.resumable.routes() if self.resumable is not None else []),
            Route("GET", "/health", Dialect.OPENAI, self._health),
            Route("HEAD", "/health", Dialect.OPENAI, self._health),
            Route("GET", "/metrics", Dialect.OPENAI, self._metrics),
            Route("POST", "/v1/models/", Dialect.OPENAI, self._load_or_unload, prefix=True),
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
        self.registry.register(ModelsCollector(models))
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
        app = mw.RequestLog(app, self.models.default.name)
        app = mw.RequestId(app)
        app = mw.Cors(app, guard)
        app = mw.Routing(app, self.routes)
        app = mw.WebSockets(app, self.websocket)
        return mw.Lifespan(app, startup=self.drain.install, shutdown=self.stop_engine)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.asgi(scope, receive, send)

    @property
    def engine(self) -> Generator:
        """The default model's engine."""
        return self._default().engine

    @property
    def renderer(self) -> chat.Renderer:
        return self._default().renderer

    def _default(self) -> ServedModel:
        served = self.models.default.served
        assert served is not None, "the default model is loaded at start-up and kept"
        return served

    async def _health(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        models = {entry.name: str(entry.state) for entry in self.models.entries.values()}
        answer = {"model": self.models.default.name, "models": models}
        if ranks.failure is not None:
            await send_json(send, 503, {"status": "failed", "error": ranks.failure, **answer})
            return
        if self.drain.draining:
            await send_json(send, 503, {"status": "draining", **answer})
            return
        await send_json(send, 200, {"status": "ok", **answer})

    async def _load_or_unload(
        self, scope: Scope, receive: Receive, send: Send, body: bytes
    ) -> None:
        """`POST /v1/models/{name}/load` (answers once it is loaded) and `.../unload` (once its
        memory is back; a model with running streams is unloaded when they end: 202)."""
        name, _, action = path_tail(scope, "/v1/models/").rstrip("/").rpartition("/")
        if action not in ("load", "unload") or not name:
            raise ApiError(ErrorKind.NOT_FOUND, f"no route for POST {scope['path']}")
        entry = self.models.listed(name)
        if action == "load":
            await self.models.ready(entry)
        elif (unloading := self.models.unload_when_idle(entry)) is not None:
            await unloading
        else:
            await send_json(send, 202, {"id": name, **self.models.status(name), "unloading": True})
            return
        await send_json(send, 200, {"id": name, **self.models.status(name)})

    def stop_engine(self) -> None:
        """Stop the engines once (the drain and the lifespan's shutdown both ask)."""
        if self._engine_stopped.acquire(blocking=False):
            self.models.stop()

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


def configured(config: Config) -> Configured:
    """The models `config` serves (--model, --models-config, --model-alias)."""
    base = ModelSpec(
        name="",
        source=None,
        context_length=config.context_length,
        rope_scaling=config.rope_scaling,
        tool_format=config.tool_format,
        reasoning_format=config.reasoning_format,
        draft_model=config.draft_model,
    )
    return read_specs(
        config.model,
        config.models_config,
        base,
        model_ttl_s=config.model_ttl,
        aliases=config.model_aliases,
    )


def build_app(config: Config, drain: Drain | None = None) -> App:
    """The app with its default model (and any pinned ones) loaded."""
    from mlxgate import blas, models

    started = time.monotonic()
    if ranks.launched():
        ranks.check_config(config)
    chosen = configured(config)
    # On a CPU every step uses every core: several models' engines take turns.
    turns = Turns() if len(chosen.specs) > 1 else None
    registry = ModelRegistry(
        chosen.specs,
        chosen.default,
        lambda spec: serve_model(spec, config, turns),
        answers_any_name=chosen.answers_any_name and not config.strict_models,
        memory_budget=int(config.max_model_memory * 2**30) or default_memory_budget(),
        estimate=lambda spec: models.stored_bytes(spec.source),
    )
    registry.load_pinned()
    served = registry.default.served
    assert served is not None
    import mlx.core as mx

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


def load_model(
    spec: ModelSpec, config: Config, shard: Callable[[nn.Module], None] | None = None
) -> LoadedModel:
    """`spec`'s model as `config` serves it (`shard`: this rank's part of it, ranks.py)."""
    from mlxgate import models

    return models.load(
        spec.source,
        trust_remote_code=config.trust_remote_code,
        context_length=spec.context_length,
        rope_scaling=spec.rope_scaling,
        weights=config.weights,
        cpu_kernels=not config.no_cpu_kernels,
        shard=shard,
    )


def serve_model(spec: ModelSpec, config: Config, turns: Turns | None = None) -> ServedModel:
    """Load `spec`'s model (and its draft model) and start its engine; launched as rank 0 of
    several, its shard and the engine that leads the others (ranks.py)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxgate import models

    started = time.monotonic()
    group = ranks.group()
    lockstep = RankGroup(group) if group is not None else None
    loaded = load_model(spec, config, ranks.sharder(group, config.pipeline) if group else None)
    tokenizer = loaded.tokenizer
    vocab = Vocab.from_token_strings(
        tokenizer.token_strings(), tokenizer.vocab_kind, sorted(tokenizer.special_ids)
    )
    renderer = chat.Renderer(
        tokenizer,
        tool_format=None if spec.tool_format == "auto" else spec.tool_format,
        reasoning_format=None if spec.reasoning_format == "auto" else spec.reasoning_format,
    )
    draft = None
    if spec.draft_model is not None:
        draft = models.load(
            spec.draft_model,
            trust_remote_code=config.trust_remote_code,
            context_length=loaded.context_length,
            rope_scaling=spec.rope_scaling,
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
    sampling, sampling_sources = SamplingParams.layered(sampling_layers(spec, config, loaded))
    if loaded.vision is not None and turns is None:
        turns = Turns()  # its vision tower's blocks and its engine's steps take turns
    turn = functools.partial(turns.turn, spec.name) if turns else contextlib.nullcontext
    vision_turn = (
        functools.partial(turns.turn, f"{spec.name} (vision)") if turns else contextlib.nullcontext
    )
    with turn():  # its start-up checks run the model: between the other engines' steps
        engine = Engine(
            loaded,
            Router(vocab),
            config.engine,
            end_ids=renderer.eos_ids,
            draft_model=draft.model if draft else None,
            turn=turn,
            vision_turn=vision_turn,
            lockstep=lockstep,
        )
    if lockstep is not None:
        lockstep.on_failure = functools.partial(ranks.leader_failed, engine)
        ranks.watch(lockstep, config.rank_timeout)
    layout = engine.layout
    weights: list[tuple[str, mx.array]] = [
        named  # type: ignore[misc]
        for model in (loaded.model, draft.model if draft else None)
        if model is not None
        for named in tree_flatten(model.parameters())
    ]
    engine.start()
    log.info(
        "model %s: %s, %s, %s, context %s, takes %s, tool calls %s, reasoning %s, kernels: %s "
        "(%s); the prefix cache reuses %s; sampling defaults: %s; loaded in %.1fs",
        spec.name,
        models.architecture(loaded.model),
        layout.describe(),
        models.precision(loaded.model),
        loaded.describe_context(),
        loaded.vision.describe() if loaded.vision is not None else "text",
        _chosen(renderer.format.tool_format.NAME, spec.tool_format),
        _chosen(renderer.format.reasoning.name, spec.reasoning_format),
        loaded.kernels,
        loaded.source,
        layout.reuse(),
        described_sampling(sampling, sampling_sources),
        time.monotonic() - started,
    )
    return ServedModel(
        spec.name,
        engine,
        renderer,
        loaded.context_length,
        weights_bytes=sum(array.nbytes for _, array in weights),
        cache_bytes=lambda: engine.metrics.kv_bytes + engine.prefix_cache.nbytes,
        metrics=EngineCollector(engine),
        vision=loaded.vision,
        sampling=sampling,
        sampling_sources=sampling_sources,
    )


# The flags that set sampling defaults (SamplingParams' names).
SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "repetition_penalty", "repetition_context_size")


def sampling_layers(
    spec: ModelSpec, config: Config, loaded: LoadedModel
) -> list[tuple[str, dict[str, float]]]:
    """Where a served model's sampling defaults come from, first to last: its --models-config
    table, the flags given, then (unless --sampling-defaults server) the model's own."""
    flags = {name: getattr(config, name) for name in SAMPLING_FLAGS}
    layers = [
        ("--models-config", dict(spec.sampling)),
        ("the flags", {name: value for name, value in flags.items() if value is not None}),
    ]
    if config.sampling_defaults == "model":
        layers.append((loaded.sampling_source, dict(loaded.sampling)))
    return layers


def described_sampling(sampling: SamplingParams, sources: dict[str, str]) -> str:
    """The defaults a model samples with, for the start-up line: "temperature 0.2, ... (from
    where)", or greedy."""
    if not sources:
        return "greedy (mlxgate's own)"
    by_source: dict[str, list[str]] = {}
    for name, source in sources.items():
        by_source.setdefault(source, []).append(f"{name} {getattr(sampling, name)}")
    return "; ".join(f"{', '.join(values)} ({source})" for source, values in by_source.items())


def _chosen(name: str, setting: str) -> str:
    return f"{name} ({'detected' if setting == 'auto' else 'set'})"


def create_app() -> Loading:
    """The ASGI app factory: granian calls it in its worker process."""
    config = Config.from_env()
    logs.configure(config.log_level, config.log_format)
    return Loading(config)
