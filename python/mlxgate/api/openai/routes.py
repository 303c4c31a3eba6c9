"""The OpenAI Chat Completions and Completions APIs: routes, model listing, admission errors."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from mlxgate import chat
from mlxgate._native import Dialect, ErrorKind, StreamSpec
from mlxgate.api.delivery import respond
from mlxgate.api.errors import ApiError, invalid
from mlxgate.api.http import Receive, Scope, Send, send_json
from mlxgate.api.openai.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    _Sampling,
    conversation,
)
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
)
from mlxgate.engine import GenerationRequest, Grammar, PromptTooLong

OPENAI = Dialect.OPENAI

ADMISSION_ERRORS: AdmissionErrors = {
    **COMMON_ADMISSION_ERRORS,
    PromptTooLong: lambda e: prompt_too_long(e, code="context_length_exceeded", param="messages"),
}


class OpenAIAPI:
    def __init__(self, services: Services) -> None:
        self.services = services

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
        self.services.models.check(request.model)
        grammar = request.grammar()
        prompt = render(self.services.renderer, conversation(request))
        await self._generate(
            scope,
            receive,
            send,
            request,
            prompt.ids,
            output_limit(self.services, request.max_completion_tokens or request.max_tokens),
            kind="chat",
            prompt=prompt,
            grammar=constraint(prompt, grammar),
        )

    async def completions(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        request = parse(CompletionRequest, body)
        self.services.models.check(request.model)
        prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        if len(prompts) != 1:
            raise ApiError(
                ErrorKind.INVALID_REQUEST, "prompt: exactly one prompt is supported", param="prompt"
            )
        ids = self.services.renderer.encode(prompts[0])
        if len(ids) < 2:  # the engine decodes from the prompt's last token after the rest
            raise invalid(
                f"prompt: must be at least 2 tokens long; this one is {len(ids)}", param="prompt"
            )
        max_tokens = output_limit(self.services, request.max_tokens)
        await self._generate(scope, receive, send, request, ids, max_tokens, kind="completion")

    async def _generate(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        request: _Sampling,
        prompt_ids: list[int],
        max_tokens: int | None,
        *,
        kind: Literal["chat", "completion"],
        prompt: chat.Prompt | None = None,
        grammar: Grammar | None = None,
    ) -> None:
        services = self.services
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        completion_id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        generation = GenerationRequest(
            prompt_ids,
            StreamSpec.openai(
                model=services.models.served,
                completion_id=completion_id,
                created=created,
                stream=request.stream,
                include_usage=bool(request.stream_options and request.stream_options.include_usage),
                kind=kind,
                stop_sequences=request.stops(),
                markup=prompt.markup if prompt else None,
                prefill=prompt.prefill if prompt else "",
                eos_ids=services.renderer.eos_ids,
                tools=prompt.tool_schemas if prompt else [],
            ),
            max_tokens,
            request.sampling(services.default_sampling),
            grammar,
            speculate=request.speculative_decoding,
            choices=request.n,
        )
        reader = admit(services.engine, generation, ADMISSION_ERRORS)
        await respond(
            scope,
            send,
            receive,
            reader,
            OPENAI,
            stream=request.stream,
            resumable=services.resumable,
        )

    def _entry(self, name: str) -> dict[str, Any]:
        created = self.services.models.created
        return {"id": name, "object": "model", "created": created, "owned_by": "mlxgate"}

    async def list_models(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        entries = [self._entry(name) for name in self.services.models.names]
        await send_json(send, 200, {"object": "list", "data": entries})

    async def retrieve_model(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        model_id = path_tail(scope, "/v1/models/")
        await send_json(send, 200, self._entry(self.services.models.listed(model_id)))
