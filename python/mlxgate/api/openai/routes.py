"""The OpenAI Chat Completions and Completions APIs: routes, model listing, admission errors."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from mlxgate._native import Dialect, ErrorKind, Reply, StreamSpec
from mlxgate.api.errors import ApiError
from mlxgate.api.http import Receive, Scope, Send, send_json
from mlxgate.api.openai.requests import ChatCompletionRequest, CompletionRequest, conversation
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

OPENAI = Dialect.OPENAI

ADMISSION_ERRORS: AdmissionErrors = {
    **COMMON_ADMISSION_ERRORS,
    PromptTooLong: lambda e: prompt_too_long(e, code="context_length_exceeded", param="messages"),
}


class OpenAIAPI:
    def __init__(self, services: Services) -> None:
        self.services = services
        self.pipeline = Pipeline(services, OPENAI, ADMISSION_ERRORS)

    def routes(self) -> list[Route]:
        return [
            Route("POST", "/v1/chat/completions", OPENAI, self.chat_completions),
            Route("POST", "/v1/completions", OPENAI, self.completions),
            Route("GET", "/v1/models", OPENAI, self.list_models),
            Route("GET", "/v1/models/", OPENAI, self.retrieve_model, prefix=True),
        ]

    async def chat_completions(
        self, scope: Scope, receive: Receive, send: Send, body: bytes
    ) -> None:
        request = parse(ChatCompletionRequest, body)
        prompt = conversation(request)
        spec = self._spec(request, "chat", custom_tools=list(prompt.custom_tools))
        await self.pipeline.answer(scope, receive, send, request, prompt, spec, choices=request.n)

    async def completions(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        request = parse(CompletionRequest, body)
        prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        if len(prompts) != 1:
            raise ApiError(
                ErrorKind.INVALID_REQUEST, "prompt: exactly one prompt is supported", param="prompt"
            )
        spec = self._spec(request, "completion")
        await self.pipeline.answer(
            scope, receive, send, request, prompts[0], spec, choices=request.n
        )

    def _spec(
        self,
        request: ChatCompletionRequest | CompletionRequest,
        kind: Literal["chat", "completion"],
        custom_tools: list[str] | None = None,
    ) -> Callable[[Reply], StreamSpec]:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        completion_id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        include_usage = bool(request.stream_options and request.stream_options.include_usage)

        def spec(reply: Reply) -> StreamSpec:
            return StreamSpec.openai(
                model=self.services.models.served,
                completion_id=completion_id,
                created=created,
                stream=request.stream,
                include_usage=include_usage,
                kind=kind,
                custom_tools=custom_tools or [],
                stop_sequences=request.stops(),
                reply=reply,
            )

        return spec

    def _entry(self, name: str) -> dict[str, Any]:
        created = self.services.models.created
        return {"id": name, "object": "model", "created": created, "owned_by": "mlxgate"}

    async def list_models(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        entries = [self._entry(name) for name in self.services.models.names]
        await send_json(send, 200, {"object": "list", "data": entries})

    async def retrieve_model(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        model_id = path_tail(scope, "/v1/models/")
        await send_json(send, 200, self._entry(self.services.models.listed(model_id)))
