"""The Anthropic Messages API: its routes, its model listing and how it words admission errors."""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from mlxgate import prompts
from mlxgate._native import Dialect, Reply, StreamSpec
from mlxgate.api import compaction
from mlxgate.api.anthropic import context
from mlxgate.api.anthropic.requests import CountTokensRequest, MessagesRequest, conversation
from mlxgate.api.anthropic.tool_search import Toolset
from mlxgate.api.http import Receive, Scope, Send, collect, send_bytes, send_json
from mlxgate.api.pipeline import (
    COMMON_ADMISSION_ERRORS,
    AdmissionErrors,
    Pipeline,
    Services,
    prompt_too_long,
)
from mlxgate.api.requests import parse
from mlxgate.api.routing import Route, path_tail
from mlxgate.api.service import model_status
from mlxgate.engine import PromptTooLong
from mlxgate.served import ServedModel

ANTHROPIC = Dialect.ANTHROPIC

ADMISSION_ERRORS: AdmissionErrors = {
    **COMMON_ADMISSION_ERRORS,
    PromptTooLong: prompt_too_long,
}


class AnthropicAPI:
    def __init__(self, services: Services) -> None:
        self.services = services
        self.pipeline = Pipeline(services, ANTHROPIC, ADMISSION_ERRORS)

    def routes(self) -> list[Route]:
        # Longest suffix first: /v1/messages/count_tokens before /v1/messages.
        return [
            Route("POST", "/v1/messages/count_tokens", ANTHROPIC, self.count_tokens),
            Route("POST", "/v1/messages", ANTHROPIC, self.messages),
            Route("GET", "/v1/models", ANTHROPIC, self.list_models, header=b"anthropic-version"),
            Route(
                "GET",
                "/v1/models/",
                ANTHROPIC,
                self.retrieve_model,
                prefix=True,
                header=b"anthropic-version",
            ),
        ]

    async def messages(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        request = parse(MessagesRequest, body)
        served = await self.pipeline.model(scope, send, request)
        managed = self.managed(served, request)
        prompt = managed.conversation
        compacting = managed.compaction is not None and managed.compaction.pause
        summary: str | None = None
        if managed.compaction is not None:
            asked = managed.compaction
            prompt = compaction.asking(prompt, asked.instructions, replace=asked.replace)
            if not managed.compaction.pause:
                summary = await self.summarize(served, request, receive, send, prompt)
                if summary is None:
                    return  # answered already: the client left, or the summary failed
                prompt = compaction.resumed(managed.conversation, summary)
        applied = orjson.dumps(managed.applied).decode() if managed.applied else None
        search = Toolset.of(request.tools or []).search

        def spec(reply: Reply, model: str) -> StreamSpec:
            return StreamSpec.anthropic(
                model=model,
                message_id=f"msg_{uuid.uuid4().hex[:24]}",
                stream=request.stream,
                compaction=compacting,
                compacted=summary,
                applied_edits=applied,
                stop_sequences=request.stop_sequences or [],
                reply=reply,
                tool_search=search.stream_params() if search else None,
            )

        await self.pipeline.answer(scope, receive, send, served, request, prompt, spec)

    def managed(self, served: ServedModel, request: CountTokensRequest) -> context.Managed:
        """The request's conversation after its context-management edits."""
        edits = request.context_management.edits if request.context_management else []

        def count(conversation: prompts.Conversation) -> int:
            return len(self.pipeline.render(served, conversation).ids)

        return context.manage(conversation(request), edits, request.compaction, count)

    async def summarize(
        self,
        served: ServedModel,
        request: MessagesRequest,
        receive: Receive,
        send: Send,
        prompt: prompts.Conversation,
    ) -> str | None:
        """The model's summary of the conversation (`prompt` asks for it), generated before the
        answer (a compaction that does not pause); None if the client left meanwhile or the
        generation failed (its error is the answer)."""

        def spec(reply: Reply, model: str) -> StreamSpec:
            return StreamSpec.anthropic(
                model=model,
                message_id=f"msg_{uuid.uuid4().hex[:24]}",
                stream=False,
                compaction=True,
                reply=reply,
            )

        reader = await self.pipeline.admit(served, compaction.Summarizing(request), prompt, spec)
        body = await collect(receive, reader)
        if body is None:
            return None
        if reader.status != 200:
            await send_bytes(send, reader.status, body)
            return None
        return (reader.result or b"").decode()

    async def count_tokens(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        request = parse(CountTokensRequest, body)
        served = await self.pipeline.loaded(request)
        prompt = await self.pipeline.prompt(served, self.managed(served, request).conversation)
        await send_json(send, 200, {"input_tokens": len(prompt.ids)})

    def _entry(self, name: str) -> dict[str, Any]:
        created = time.gmtime(self.services.models.created)
        created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", created)
        entry = {"type": "model", "id": name, "display_name": name, "created_at": created_at}
        return entry | model_status(self.services.models, name)

    async def list_models(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        names = self.services.models.names
        page = {
            "data": [self._entry(name) for name in names],
            "has_more": False,
            "first_id": names[0],
            "last_id": names[-1],
        }
        await send_json(send, 200, page)

    async def retrieve_model(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        model_id = path_tail(scope, "/v1/models/")
        self.services.models.listed(model_id)
        await send_json(send, 200, self._entry(model_id))
