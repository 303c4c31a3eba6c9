"""The Anthropic Messages API: its routes, its model listing and how it words admission errors."""

from __future__ import annotations

import time
import uuid
from typing import Any

from mlxgate._native import Dialect, StreamSpec
from mlxgate.api.anthropic.requests import CountTokensRequest, MessagesRequest, conversation
from mlxgate.api.delivery import respond
from mlxgate.api.http import Receive, Scope, Send, send_json
from mlxgate.api.shared import (
    COMMON_ADMISSION_ERRORS,
    AdmissionErrors,
    Route,
    Services,
    admit,
    constraint,
    output_limit,
    parse,
    path_tail,
    prompt_too_long,
    render,
    sampling,
)
from mlxgate.engine import GenerationRequest, PromptTooLong

ANTHROPIC = Dialect.ANTHROPIC

ADMISSION_ERRORS: AdmissionErrors = {
    **COMMON_ADMISSION_ERRORS,
    PromptTooLong: prompt_too_long,
}


class AnthropicAPI:
    def __init__(self, services: Services) -> None:
        self.services = services

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
        services = self.services
        request = parse(MessagesRequest, body)
        services.models.check(request.model)
        max_tokens = output_limit(services, request.max_tokens)
        grammar = request.grammar()
        prompt = render(services.renderer, conversation(request))
        stream = StreamSpec.anthropic(
            model=services.models.served,
            message_id=f"msg_{uuid.uuid4().hex[:24]}",
            stream=request.stream,
            stop_sequences=request.stop_sequences or [],
            markup=prompt.markup,
            prefill=prompt.prefill,
            eos_ids=services.renderer.eos_ids,
            tools=prompt.tool_schemas,
        )
        generation = GenerationRequest(
            prompt.ids,
            stream,
            max_tokens=max_tokens,
            sampling=sampling(
                services.default_sampling,
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=request.top_k,
            ),
            grammar=constraint(prompt, grammar),
            speculate=request.speculative_decoding,
        )
        reader = admit(services.engine, generation, ADMISSION_ERRORS)
        await respond(
            scope,
            send,
            receive,
            reader,
            ANTHROPIC,
            stream=request.stream,
            resumable=services.resumable,
        )

    async def count_tokens(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        request = parse(CountTokensRequest, body)
        self.services.models.check(request.model)
        prompt = render(self.services.renderer, conversation(request))
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
