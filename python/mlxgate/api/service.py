"""The server's own routes beside the dialects': `/health`, `/metrics`, and loading or unloading
a model by name (`POST /v1/models/{name}/load`, `.../unload`); what every dialect's model
listing says of a model."""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from mlxgate import ranks
from mlxgate._native import Dialect, ErrorKind
from mlxgate.api.drain import Drain
from mlxgate.api.errors import ApiError
from mlxgate.api.http import Receive, Scope, Send, send_bytes, send_json
from mlxgate.api.routing import Route, path_tail
from mlxgate.registry import ModelRegistry


def model_status(models: ModelRegistry, name: str) -> dict[str, Any]:
    """What /v1/models says of the model `name` names besides its id: its state, its context
    once known, and once loaded, the sampling defaults a request gets."""
    entry = models.listed(name)
    served = entry.served
    context = served.context_length if served is not None else entry.spec.context_length
    status: dict[str, Any] = {
        "state": str(entry.state),
        "context_length": context,
        "pinned": entry.forever(),
    }
    if served is not None:
        status["sampling_defaults"] = served.sampling.defaults()
        status["sampling_defaults_from"] = served.sampling_sources
    return status


class ServiceAPI:
    """The routes that tell how the server is (health, metrics) and load or unload models."""

    def __init__(self, models: ModelRegistry, drain: Drain, metrics: CollectorRegistry) -> None:
        self.models = models
        self.drain = drain
        self.metrics = metrics

    def routes(self) -> list[Route]:
        return [
            Route("GET", "/health", Dialect.OPENAI, self.health),
            Route("HEAD", "/health", Dialect.OPENAI, self.health),
            Route("GET", "/metrics", Dialect.OPENAI, self.scrape),
            Route("POST", "/v1/models/", Dialect.OPENAI, self.load_or_unload, prefix=True),
        ]

    async def health(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        models = {entry.name: str(entry.state) for entry in self.models.entries.values()}
        answer = {"model": self.models.default.name, "models": models}
        if ranks.failure is not None:
            await send_json(send, 503, {"status": "failed", "error": ranks.failure, **answer})
            return
        if self.drain.draining:
            await send_json(send, 503, {"status": "draining", **answer})
            return
        await send_json(send, 200, {"status": "ok", **answer})

    async def load_or_unload(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
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
            await send_json(
                send, 202, {"id": name, **model_status(self.models, name), "unloading": True}
            )
            return
        await send_json(send, 200, {"id": name, **model_status(self.models, name)})

    async def scrape(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        body = generate_latest(self.metrics)
        await send_bytes(send, 200, body, CONTENT_TYPE_LATEST.encode())
