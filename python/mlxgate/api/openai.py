"""The OpenAI Chat Completions and Completions APIs over the same engine and rendering."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mlxgate import chat
from mlxgate.api.anthropic import parse
from mlxgate.api.errors import ApiError, invalid
from mlxgate.api.http import Receive, Scope, Send, respond
from mlxgate.api.models import ModelNames
from mlxgate.engine import AdmissionError, Engine, GenerationRequest, SamplingParams


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Lenient):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionSpec(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ToolSpec(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionSpec


class StreamOptions(_Lenient):
    include_usage: bool = False


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]


class _Sampling(_Lenient):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = None
    n: int = 1
    logprobs: bool | int | None = None

    def sampling(self, defaults: SamplingParams) -> SamplingParams:
        return SamplingParams(
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
            seed=self.seed,
        )

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def check(self) -> None:
        if self.n != 1:
            raise ApiError(400, "n: only n=1 is supported", param="n", should_retry=False)
        if self.logprobs:
            raise ApiError(400, "logprobs are not supported by this server", param="logprobs")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # Accepted; the reply is not constrained (documented in the README).
    response_format: ResponseFormat | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    max_tokens: int = Field(default=16, ge=1)


def _text(content: str | list[ContentPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for i, part in enumerate(content):
        if part.type != "text":
            raise invalid(f"{where}.content.{i}: content part type {part.type!r} is not supported")
        parts.append(part.text or "")
    return "\n".join(parts)


def _arguments(call: ToolCall, where: str) -> dict[str, Any]:
    arguments = call.function.arguments
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        raise invalid(f"{where}: function.arguments is not valid JSON") from None
    if not isinstance(parsed, dict):
        raise invalid(f"{where}: function.arguments must be a JSON object")
    return parsed


def _messages(request: ChatCompletionRequest) -> list[chat.Message]:
    out: list[chat.Message] = []
    for i, message in enumerate(request.messages):
        where = f"messages.{i}"
        text = _text(message.content, where)
        if message.role in ("system", "developer"):
            out.append({"role": "system", "content": text})
        elif message.role == "tool":
            out.append({"role": "tool", "tool_call_id": message.tool_call_id, "content": text})
        elif message.role == "assistant" and message.tool_calls:
            calls = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": _arguments(call, where)},
                }
                for call in message.tool_calls
            ]
            out.append({"role": "assistant", "content": text, "tool_calls": calls})
        else:
            out.append({"role": message.role, "content": text})
    return chat.merge_turns(out)


def _tool_choice(request: ChatCompletionRequest) -> chat.ToolChoice | None:
    choice = request.tool_choice
    if choice is None or choice == "auto":
        return None
    if choice == "none":
        return chat.ToolChoice("none")
    if choice == "required":
        return chat.ToolChoice("any")
    assert isinstance(choice, NamedToolChoice)
    return chat.ToolChoice("tool", choice.function.name)


class OpenAIAPI:
    def __init__(
        self, engine: Engine, models: ModelNames, default_sampling: SamplingParams
    ) -> None:
        self.engine = engine
        self.models = models
        self.default_sampling = default_sampling
        self.tokenizer = engine.loaded.tokenizer
        self.format = chat.ChatFormat.detect(self.tokenizer)

    async def chat_completions(
        self, scope: Scope, receive: Receive, send: Send, body: bytes
    ) -> None:
        request: ChatCompletionRequest = parse(ChatCompletionRequest, body)
        request.check()
        self.models.check(request.model)
        tools = [
            {"type": "function", "function": t.function.model_dump()} for t in request.tools or []
        ]
        choice = _tool_choice(request)
        try:
            prompt = chat.render(
                self.tokenizer, self.format, _messages(request), tools=tools, tool_choice=choice
            )
        except chat.ConversationError as exc:
            raise invalid(str(exc)) from None
        with_tools = bool(tools) and (choice is None or choice.mode != "none")
        max_tokens = (
            request.max_completion_tokens or request.max_tokens or self.engine.context_length
        )
        await self._generate(
            scope,
            receive,
            send,
            request,
            self.tokenizer.encode(prompt.text),
            max_tokens,
            kind="chat",
            markup=self.format.markup(with_tools),
            prefill=prompt.prefill,
        )

    async def completions(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        request: CompletionRequest = parse(CompletionRequest, body)
        request.check()
        self.models.check(request.model)
        prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        if len(prompts) != 1:
            raise ApiError(400, "prompt: exactly one prompt is supported", param="prompt")
        ids = self.tokenizer.encode(prompts[0])
        if not ids:
            raise invalid("prompt: must not be empty")
        await self._generate(
            scope, receive, send, request, ids, request.max_tokens, kind="completion"
        )

    async def _generate(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        request: _Sampling,
        prompt_ids: list[int],
        max_tokens: int,
        *,
        kind: Literal["chat", "completion"],
        markup: Any = None,
        prefill: str = "",
    ) -> None:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        completion_id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        try:
            reader = self.engine.submit(
                GenerationRequest(prompt_ids, max_tokens, request.sampling(self.default_sampling)),
                lambda stream_id, cached_tokens: self.engine.router.open_openai(
                    stream_id,
                    model=self.models.served,
                    completion_id=completion_id,
                    created=int(time.time()),
                    prompt_tokens=len(prompt_ids),
                    cached_tokens=cached_tokens,
                    stop_sequences=request.stops(),
                    stream=request.stream,
                    include_usage=include_usage,
                    kind=kind,
                    markup=markup,
                    prefill=prefill,
                ),
            )
        except AdmissionError as exc:
            raise ApiError.from_admission(exc, "openai") from None
        await respond(send, receive, reader, stream=request.stream, dialect="openai")
