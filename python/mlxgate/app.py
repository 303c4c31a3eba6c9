"""The ASGI application: routes requests to the API dialects; the factory granian calls."""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, generate_latest

from mlxgate._native import Router, Vocab
from mlxgate.api.anthropic import AnthropicAPI
from mlxgate.api.errors import ApiError, Dialect
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
from mlxgate.config import Config
from mlxgate.engine import Engine, SamplingParams
from mlxgate.metrics import EngineCollector

log = logging.getLogger("mlxgate")

Handler = Callable[[Scope, Receive, Send, bytes], Awaitable[None]]


class App:
    """Routes by path suffix, so a base-URL prefix (`http://host/some/prefix`) works too.

    Each route has a dialect; every error on it is answered in that dialect's envelope.
    """

    def __init__(self, engine: Engine, config: Config) -> None:
        self.engine = engine
        self.config = config
        self.models = ModelNames(
            engine.loaded.name,
            config.model_aliases,
            strict=config.strict_models,
            model_arg=config.model,
        )
        default_sampling = SamplingParams(config.temperature, config.top_p, config.top_k)
        self.anthropic = AnthropicAPI(
            engine, self.models, default_sampling, config.max_output_tokens
        )
        self.openai = OpenAIAPI(engine, self.models, default_sampling)
        # Longest suffix first: /v1/messages/count_tokens before /v1/messages.
        self.post_routes: list[tuple[str, Dialect, Handler]] = [
            ("/v1/messages/count_tokens", "anthropic", self.anthropic.count_tokens),
            ("/v1/messages", "anthropic", self.anthropic.messages),
            ("/v1/chat/completions", "openai", self.openai.chat_completions),
            ("/v1/completions", "openai", self.openai.completions),
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
        route, dialect, handler = self._route(scope, method, path)
        status = 0

        async def send_tracked(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if not path.endswith("/health") and not self._authorized(scope):
                raise ApiError(
                    401,
                    "invalid x-api-key or Authorization bearer token",
                    should_retry=False,
                    code="invalid_api_key",
                )
            if handler is not None:
                body = await read_body(receive, self.config.max_body_bytes)
                with self._client_slot(scope, route):
                    await handler(scope, receive, send_tracked, body)
            elif method in ("GET", "HEAD") and path.endswith("/health"):
                health = {"status": "ok", "model": self.models.served}
                await send_json(send_tracked, 200, health)
            elif method == "GET" and path.endswith("/metrics"):
                await send_bytes(send_tracked, 200, generate_latest(), CONTENT_TYPE_LATEST.encode())
            elif method == "GET" and path.endswith("/v1/models"):
                await self.models.list(scope, send_tracked)
            elif method == "GET" and "/v1/models/" in path:
                model_id = path.split("/v1/models/", 1)[1]
                await self.models.retrieve(scope, send_tracked, model_id)
            else:
                raise ApiError(404, f"{method} {scope['path']} is not a route of this server")
        except ApiError as exc:
            await send_json(
                send_tracked, exc.status, exc.body(dialect), extra_headers=exc.headers()
            )
        except BodyTooLarge as exc:
            await send_json(send_tracked, 413, ApiError(413, str(exc)).body(dialect))
        except ClientGone:
            pass
        except Exception:
            log.exception("unhandled error on %s %s", method, path)
            if status == 0:
                error = ApiError(500, "internal server error (the server log has the details)")
                await send_json(send_tracked, 500, error.body(dialect))
        finally:
            self.requests.labels(route, str(status or 499)).inc()

    def _route(self, scope: Scope, method: str, path: str) -> tuple[str, Dialect, Handler | None]:
        if method == "POST":
            for route, dialect, handler in self.post_routes:
                if path.endswith(route):
                    return route, dialect, handler
        # Anything else: OpenAI's envelope where the path is OpenAI's; the model routes serve
        # both dialects, and the anthropic-version header tells them apart.
        if path.endswith("/v1/models") or "/v1/models/" in path:
            openai_path = header(scope, b"anthropic-version") is None
        else:
            openai_path = "completions" in path or "embeddings" in path
        route = path if path.endswith(("/health", "/metrics", "/v1/models")) else "other"
        return route, "openai" if openai_path else "anthropic", None

    @contextlib.contextmanager
    def _client_slot(self, scope: Scope, route: str) -> Iterator[None]:
        """Bound the requests one client may have in flight (`--max-per-client`)."""
        limit = self.config.max_per_client
        if not limit or route.endswith("count_tokens"):
            yield
            return
        client = (
            header(scope, b"x-api-key")
            or (header(scope, b"authorization") or "").removeprefix("Bearer ")
            or str((scope.get("client") or ("?",))[0])
        )
        if self._in_flight[client] >= limit:
            raise ApiError(
                429,
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


def build_app(config: Config) -> App:
    from mlxgate import blas, models

    started = time.monotonic()
    loaded = models.load(config.model)
    tokenizer = loaded.tokenizer
    vocab = Vocab.from_token_strings(
        tokenizer.token_strings(), tokenizer.vocab_kind, sorted(tokenizer.special_ids)
    )
    engine = Engine(loaded, Router(vocab), config.engine)
    engine.start()
    REGISTRY.register(EngineCollector(engine))
    import mlx.core as mx

    log.info(
        "mlxgate ready: model %s (context %d, %s), device %s, BLAS %s, loaded in %.1fs. "
        "Point clients at http://%s:%d (ANTHROPIC_BASE_URL, or OPENAI_BASE_URL=.../v1)",
        loaded.name,
        loaded.context_length,
        loaded.source,
        mx.default_device(),
        blas.blas_in_use(),
        time.monotonic() - started,
        config.host,
        config.port,
    )
    return App(engine, config)


def create_app() -> App:
    """The ASGI app factory: granian calls it in its worker process."""
    config = Config.from_env()
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return build_app(config)
