"""The Anthropic Messages API: its routes, its model listing and how it words admission errors."""

from __future__ import annotations

import time
import uuid
from typing import Any

from mlxgate._native import Dialect, Reply, StreamSpec
from mlxgate.api.anthropic.requests import CountTokensRequest, MessagesRequest, conversation
from mlxgate.api.anthropic.tool_search import Toolset
from mlxgate.api.http import Receive, Scope, Send, send_json
from mlxgate.api.pipeline import (
    COMMON_ADMISSION_ERRORS,
    AdmissionErrors,
    Pipeline,
    Services,
    prompt_too_long,
)
from mlxgate.api.requests import parse
from mlxgate.api.routing import Route, path_tail
from mlxgate.engine import PromptTooLong

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
        search = Toolset.of(request.tools or []).search

        def spec(reply: Reply) -> StreamSpec:
            return StreamSpec.anthropic(
                model=self.services.models.served,
                message_id=f"msg_{uuid.uuid4().hex[:24]}",
                stream=request.stream,
                stop_sequences=request.stop_sequences or [],
                reply=reply,
                tool_search=search.stream_params() if search else None,
            )

        await self.pipeline.answer(scope, receive, send, request, conversation(request), spec)

    async def count_tokens(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        request = parse(CountTokensRequest, body)
        self.services.models.check(request.model)
        prompt = self.pipeline.render(conversation(request))
        await send_json(send, 200, {"input_tokens": len(prompt.ids)})

    def _entry(self, name: str) -> dict[str, Any]:
        created = time.gmtime(self.services.models.created)
        created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", created)
        return {"type": "model", "id": name, "display_name": name, "created_at": created_at}

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
        await send_json(send, 200, self._entry(self.services.models.listed(model_id)))
