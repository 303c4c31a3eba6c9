"""The OpenAI Chat Completions and Completions APIs: routes, model listing, admission errors."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from mlxgate._native import Dialect, ErrorKind, Reply, StreamSpec
from mlxgate.api.errors import ApiError
from mlxgate.api.http import Receive, Scope, Send, send_json
from mlxgate.api.openai.requests import ChatCompletionRequest, CompletionRequest, conversation
from mlxgate.api.openai_common import admission_errors
from mlxgate.api.pipeline import (
    AdmissionErrors,
    Pipeline,
    Services,
    SpecFor,
)
from mlxgate.api.requests import parse
from mlxgate.api.routing import Route, path_tail
from mlxgate.api.service import model_status

OPENAI = Dialect.OPENAI

ADMISSION_ERRORS: AdmissionErrors = admission_errors(prompt_field="messages")


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
        served = await self.pipeline.model(scope, send, request)
        await self.pipeline.answer(
            scope, receive, send, served, request, prompt, spec, choices=request.n
        )

    async def completions(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        request = parse(CompletionRequest, body)
        prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        if len(prompts) != 1:
            raise ApiError(
                ErrorKind.INVALID_REQUEST, "prompt: exactly one prompt is supported", param="prompt"
            )
        spec = self._spec(request, "completion")
        served = await self.pipeline.model(scope, send, request)
        await self.pipeline.answer(
            scope, receive, send, served, request, prompts[0], spec, choices=request.n
        )

    def _spec(
        self,
        request: ChatCompletionRequest | CompletionRequest,
        kind: Literal["chat", "completion"],
        custom_tools: list[str] | None = None,
    ) -> SpecFor:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        completion_id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        include_usage = bool(request.stream_options and request.stream_options.include_usage)

        def spec(reply: Reply, model: str) -> StreamSpec:
            return StreamSpec.openai(
                model=model,
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
        entry = {"id": name, "object": "model", "created": created, "owned_by": "mlxgate"}
        return entry | model_status(self.services.models, name)

    async def list_models(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        entries = [self._entry(name) for name in self.services.models.names]
        await send_json(send, 200, {"object": "list", "data": entries})

    async def retrieve_model(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        model_id = path_tail(scope, "/v1/models/")
        self.services.models.listed(model_id)
        await send_json(send, 200, self._entry(model_id))
