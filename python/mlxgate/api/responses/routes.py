"""The OpenAI Responses API: `POST /v1/responses`, stored responses, admission errors."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from mlxgate import prompts
from mlxgate._native import Dialect, Reply, StreamSpec
from mlxgate.api.http import Receive, Scope, Send, send_bytes, send_json
from mlxgate.api.openai_common import admission_errors
from mlxgate.api.pipeline import (
    AdmissionErrors,
    Pipeline,
    Services,
)
from mlxgate.api.requests import parse
from mlxgate.api.responses.requests import Item, ResponsesRequest, conversation, text, tools
from mlxgate.api.responses.store import ResponseStore, StoredResponse
from mlxgate.api.routing import Route, path_tail

RESPONSES = Dialect.RESPONSES

ADMISSION_ERRORS: AdmissionErrors = admission_errors(prompt_field="input")


@dataclass(frozen=True)
class Prepared:
    """A request ready for the pipeline: its response's id, the conversation to answer and how
    its stream is opened."""

    response_id: str
    conversation: prompts.Conversation
    spec: Callable[[Reply | None, str], StreamSpec]


def _kept_content(content: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """A user message's content as a compaction keeps it: its text, and its images as sent."""
    if isinstance(content, list) and any(part.get("type") == "input_image" for part in content):
        return [
            part if part.get("type") == "input_image" else _kept_content([part])[0]
            for part in content
        ]
    return [{"type": "input_text", "text": text(content, "input")}]


class ResponsesAPI:
    def __init__(self, services: Services) -> None:
        self.services = services
        self.store = ResponseStore(services.config.responses_store_mb << 20)
        self.pipeline = Pipeline(services, RESPONSES, ADMISSION_ERRORS)

    def routes(self) -> list[Route]:
        return [
            Route("POST", "/v1/responses", RESPONSES, self.create),
            Route("POST", "/v1/responses/compact", RESPONSES, self.compact),
            Route("GET", "/v1/responses/", RESPONSES, self.retrieve, prefix=True),
            Route("DELETE", "/v1/responses/", RESPONSES, self.delete, prefix=True),
        ]

    async def create(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        request = parse(ResponsesRequest, body)
        prepared = self.prepare(request, self.history(request.previous_response_id))
        served = await self.pipeline.model(scope, send, request)
        reader = await self.pipeline.answer(
            scope, receive, send, served, request, prepared.conversation, prepared.spec
        )
        self.keep(request, prepared.response_id, reader.result)

    def history(self, previous_id: str | None) -> list[Item]:
        """The stored conversation a `previous_response_id` continues (a 404 for an unknown id)."""
        if previous_id is None:
            return []
        return [Item.model_validate(item) for item in self.store.history(previous_id)]

    def prepare(
        self, request: ResponsesRequest, history: list[Item], kept: str | None = None
    ) -> Prepared:
        """What answering `request` after `history` takes, over HTTP or a WebSocket; with `kept`
        (the JSON array of its user messages), as `/v1/responses/compact` answers."""
        given = tools(request)
        response_id = f"resp_{uuid.uuid4().hex}"
        compaction: Literal["item", "endpoint"] | None = (
            "endpoint" if kept is not None else "item" if request.compacting else None
        )
        echo = orjson.dumps(request.echo(given.served)).decode() if kept is None else "{}"

        def spec(reply: Reply | None, model: str) -> StreamSpec:
            return StreamSpec.responses(
                model=model,
                response_id=response_id,
                created_at=int(time.time()),
                echo=echo,
                stream=request.stream,
                reasoning_summary=request.reasoning_summary,
                encrypted_reasoning=request.encrypted_reasoning,
                namespaced=given.namespaced,
                custom_tools=given.custom_names,
                compaction=compaction,
                kept_items=kept,
                reply=reply,
            )

        return Prepared(response_id, conversation(request, history, given), spec)

    def keep(self, request: ResponsesRequest, response_id: str, response: bytes | None) -> None:
        """Store the Response object `request` was answered with, if it asked to (`store`)."""
        if request.store and response is not None:
            inputs = [item.model_dump(exclude_unset=True) for item in request.items]
            self.store.put(
                response_id, StoredResponse(response, inputs, request.previous_response_id)
            )

    async def compact(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        """`POST /v1/responses/compact`: the conversation's user messages and one `compaction`
        item with the model's summary of it (not streamed, not stored)."""
        request = parse(ResponsesRequest, body)
        request.stream, request.store = False, False
        history = self.history(request.previous_response_id)
        items = [*history, *request.items]
        kept = [
            {"type": "message", "role": "user", "content": _kept_content(item.content)}
            for item in items
            if item.type == "message" and item.role == "user"
        ]
        request.input = [*request.items, Item(type="compaction_trigger")]
        prepared = self.prepare(request, history, kept=orjson.dumps(kept).decode())
        served = await self.pipeline.model(scope, send, request)
        await self.pipeline.answer(
            scope, receive, send, served, request, prepared.conversation, prepared.spec
        )

    def _response_id(self, scope: Scope) -> str:
        return path_tail(scope, "/v1/responses/")

    async def retrieve(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        stored = self.store.get(self._response_id(scope))
        await send_bytes(send, 200, stored.response)

    async def delete(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        response_id = self._response_id(scope)
        self.store.get(response_id)  # 404 if unknown
        self.store.delete(response_id)
        deleted: dict[str, Any] = {"id": response_id, "object": "response", "deleted": True}
        await send_json(send, 200, deleted)
