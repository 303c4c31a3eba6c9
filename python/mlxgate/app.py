"""The ASGI application: routes requests to the API dialects; the factory granian calls."""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, generate_latest

from mlxgate import chat
from mlxgate._native import Dialect, ErrorKind, Router, Vocab
from mlxgate.api.anthropic import AnthropicAPI
from mlxgate.api.errors import ApiError
from mlxgate.api.http import (
    BodyTooLarge,
    ClientGone,
    Message,
    Receive,
    Scope,
    Send,
    header,
    read_body,
    send_bytes,
    send_json,
)
from mlxgate.api.models import ModelNames
from mlxgate.api.openai import OpenAIAPI
from mlxgate.api.responses import ResponsesAPI
from mlxgate.api.shared import Route, Services
from mlxgate.config import Config
from mlxgate.engine import Engine, Generator, SamplingParams
from mlxgate.engine.drafter import check_vocabularies
from mlxgate.metrics import EngineCollector

log = logging.getLogger("mlxgate")

# Each dialect's routes; adding a dialect is one line here.
DIALECTS = (AnthropicAPI, OpenAIAPI, ResponsesAPI)


class App:
    """Routes by path suffix, so a base-URL prefix (`http://host/some/prefix`) works too.

    Each route has a dialect; every error on it is answered in that dialect's envelope.
    """

    def __init__(
        self, engine: Generator, renderer: chat.Renderer, served: str, config: Config
    ) -> None:
        self.engine = engine
        self.config = config
        self.models = ModelNames(
            served, config.model_aliases, strict=config.strict_models, model_arg=config.model
        )
        services = Services(
            engine=engine,
            renderer=renderer,
            models=self.models,
            default_sampling=SamplingParams(config.temperature, config.top_p, config.top_k),
            config=config,
            max_output_tokens=config.max_output_tokens,
        )
        self.routes: list[Route] = [
            *(route for api in DIALECTS for route in api(services).routes()),
            Route("GET", "/health", Dialect.OPENAI, self._health),
            Route("HEAD", "/health", Dialect.OPENAI, self._health),
            Route("GET", "/metrics", Dialect.OPENAI, self._metrics),
        ]
        self._in_flight: collections.Counter[str] = collections.Counter()
        self.requests = Counter(
            "mlxgate_http_requests_total", "HTTP requests by route and status", ["route", "status"]
        )

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

        async def send_tracked(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if not path.endswith("/health") and not self._authorized(scope):
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
                body = await read_body(receive, self.config.max_body_bytes)
            with self._client_slot(scope, method, label):
                await route.handler(scope, receive, send_tracked, body)
        except ApiError as exc:
            await send_bytes(
                send_tracked, exc.status(dialect), exc.body(dialect), extra_headers=exc.headers()
            )
        except BodyTooLarge as exc:
            error = ApiError(ErrorKind.REQUEST_TOO_LARGE, str(exc))
            await send_bytes(send_tracked, error.status(dialect), error.body(dialect))
        except ClientGone:
            pass
        except Exception:
            log.exception("unhandled error on %s %s", method, path)
            if status == 0:
                error = ApiError(
                    ErrorKind.INTERNAL, "internal server error (the server log has the details)"
                )
                await send_bytes(send_tracked, error.status(dialect), error.body(dialect))
        finally:
            self.requests.labels(label, str(status or 499)).inc()

    def _route(self, scope: Scope, method: str, path: str) -> Route | None:
        for route in self.routes:
            if route.method != method or (route.header and header(scope, route.header) is None):
                continue
            if route.matches(path):
                return route
        return None

    async def _health(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        await send_json(send, 200, {"status": "ok", "model": self.models.served})

    async def _metrics(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        await send_bytes(send, 200, generate_latest(), CONTENT_TYPE_LATEST.encode())

    @contextlib.contextmanager
    def _client_slot(self, scope: Scope, method: str, route: str) -> Iterator[None]:
        """Bound the generation requests one client may have in flight (`--max-per-client`)."""
        limit = self.config.max_per_client
        if not limit or method != "POST" or route.endswith("count_tokens"):
            yield
            return
        client = (
            header(scope, b"x-api-key")
            or (header(scope, b"authorization") or "").removeprefix("Bearer ")
            or str((scope.get("client") or ("?",))[0])
        )
        if self._in_flight[client] >= limit:
            raise ApiError(
                ErrorKind.RATE_LIMITED,
                f"rate limit: at most {limit} concurrent requests per client",
                retry_after_s=1,
                code="rate_limit_exceeded",
            )
        self._in_flight[client] += 1
        try:
            yield
        finally:
            self._in_flight[client] -= 1
            if not self._in_flight[client]:
                del self._in_flight[client]

    def _authorized(self, scope: Scope) -> bool:
        key = self.config.api_key
        if not key:
            return True
        bearer = header(scope, b"authorization") or ""
        return header(scope, b"x-api-key") == key or bearer == f"Bearer {key}"

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.engine.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return


def _fallback_dialect(path: str) -> Dialect:
    """The envelope for a path no route has: OpenAI's where the path looks like OpenAI's."""
    openai = any(word in path for word in ("completions", "embeddings", "/v1/models", "responses"))
    return Dialect.OPENAI if openai else Dialect.ANTHROPIC


def build_app(config: Config) -> App:
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
    return App(engine, renderer, loaded.name, config)


def _chosen(name: str, setting: str) -> str:
    return f"{name} ({'detected' if setting == 'auto' else 'set'})"


def create_app() -> App:
    """The ASGI app factory: granian calls it in its worker process."""
    config = Config.from_env()
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return build_app(config)
