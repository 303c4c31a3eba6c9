"""The ASGI application: routes requests to the API dialects; the factory granian calls."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from mlxgate._native import Router, Vocab
from mlxgate.api.anthropic import AnthropicAPI, InvalidRequest, send_error
from mlxgate.api.http import (
    BodyTooLarge,
    ClientGone,
    Receive,
    Scope,
    Send,
    header,
    read_body,
    send_json,
)
from mlxgate.config import Config
from mlxgate.engine import Engine, EngineSettings, SamplingParams

log = logging.getLogger("mlxgate")

Handler = Callable[[Scope, Receive, Send, bytes], Awaitable[None]]


class App:
    """Routes by path suffix, so a base-URL prefix (`http://host/some/prefix`) works too."""

    def __init__(self, engine: Engine, config: Config) -> None:
        self.engine = engine
        self.config = config
        self.model_name = engine.loaded.name
        self.created = int(time.time())
        default_sampling = SamplingParams(config.temperature, config.top_p, config.top_k)
        self.anthropic = AnthropicAPI(engine, self.model_name, default_sampling)
        self.post_routes: dict[str, Handler] = {
            "/v1/messages": self.anthropic.messages,
            "/v1/messages/count_tokens": self.anthropic.count_tokens,
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path: str = scope["path"].rstrip("/") or "/"
        method: str = scope["method"]
        try:
            if method == "POST" and (handler := self._post_handler(path)):
                body = await read_body(receive, self.config.max_body_bytes)
                await handler(scope, receive, send, body)
            elif method in ("GET", "HEAD") and path.endswith("/health"):
                await send_json(send, 200, {"status": "ok", "model": self.model_name})
            elif method == "GET" and path.endswith("/v1/models"):
                await self._models(scope, send)
            else:
                await send_error(
                    send, 404, f"{method} {scope['path']} is not a route of this server"
                )
        except InvalidRequest as exc:
            await send_error(send, 400, str(exc))
        except BodyTooLarge as exc:
            await send_error(send, 413, str(exc))
        except ClientGone:
            pass
        except Exception:
            log.exception("unhandled error on %s %s", method, path)
            await send_error(send, 500, "internal server error")

    def _post_handler(self, path: str) -> Handler | None:
        for route, handler in self.post_routes.items():
            if path.endswith(route):
                return handler
        return None

    async def _models(self, scope: Scope, send: Send) -> None:
        if header(scope, b"anthropic-version") is not None:
            entry: dict[str, object] = {
                "type": "model",
                "id": self.model_name,
                "display_name": self.model_name,
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created)),
            }
            await send_json(
                send,
                200,
                {
                    "data": [entry],
                    "has_more": False,
                    "first_id": self.model_name,
                    "last_id": self.model_name,
                },
            )
        else:
            entry = {
                "id": self.model_name,
                "object": "model",
                "created": self.created,
                "owned_by": "mlxgate",
            }
            await send_json(send, 200, {"object": "list", "data": [entry]})

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
    settings = EngineSettings(
        max_queued=config.max_queued,
        max_running=config.max_running,
        step_token_budget=config.step_token_budget,
        prefix_cache_bytes=config.prefix_cache_mb << 20,
    )
    engine = Engine(loaded, Router(vocab), settings)
    engine.start()
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
