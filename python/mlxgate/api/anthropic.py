"""The Anthropic Messages API: request validation, prompt rendering, responses and errors."""

from __future__ import annotations

import uuid
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mlxgate import chat
from mlxgate.api.errors import ApiError, invalid
from mlxgate.api.http import Receive, Scope, Send, respond, send_json
from mlxgate.api.models import ModelNames
from mlxgate.engine import AdmissionError, Engine, GenerationRequest, SamplingParams
from mlxgate.models.tokenizer import ChatTokenizer

# Claude Code sends a per-session block that would defeat prefix reuse; it carries no instructions.
BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentBlock(BaseModel):
    """Any content block; the fields of the types mlxgate understands are typed."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: str | list[ContentBlock] | None = None
    is_error: bool | None = None
    tool_name: str | None = None


class InputMessage(_Lenient):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class SystemBlock(_Lenient):
    type: Literal["text"]
    text: str


class ToolSpec(_Lenient):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    defer_loading: bool = False


class ToolChoiceSpec(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class ThinkingSpec(_Lenient):
    type: str


class _Conversation(_Lenient):
    model: str
    messages: list[InputMessage]
    system: str | list[SystemBlock] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoiceSpec | None = None
    thinking: ThinkingSpec | None = None


class MessagesRequest(_Conversation):
    max_tokens: int = Field(ge=1)
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)


class CountTokensRequest(_Conversation):
    pass


def _validation_message(exc: ValidationError) -> str:
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}" if where else first["msg"]


def parse(model: type[BaseModel], body: bytes) -> Any:
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise invalid(f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise invalid("request body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise invalid(_validation_message(exc)) from None


def _tool_result_text(block: ContentBlock) -> str:
    if isinstance(block.content, str) or block.content is None:
        text = block.content or ""
    else:
        parts = []
        for inner in block.content:
            if inner.type == "text":
                parts.append(inner.text or "")
            elif inner.type == "tool_reference":
                parts.append(f"Tool loaded: {inner.tool_name}")
            elif inner.type == "image":
                raise invalid("tool_result images are not supported by this model")
        text = "\n".join(parts)
    return f"Error: {text}" if block.is_error else text


def _convert_message(index: int, message: InputMessage) -> list[chat.Message]:
    """One Anthropic message as chat-template turns (tool results become `tool` turns)."""
    role = "user" if message.role == "system" else message.role  # Claude Code sends these
    if isinstance(message.content, str):
        return (
            [{"role": role, "content": message.content}]
            if message.content or role != "user"
            else []
        )
    turns: list[chat.Message] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []

    def flush_text() -> None:
        if texts:
            turns.append({"role": role, "content": "\n".join(texts)})
            texts.clear()

    for i, block in enumerate(message.content):
        where = f"messages.{index}.content.{i}"
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type in ("thinking", "redacted_thinking"):
            continue  # earlier reasoning is not replayed into the prompt
        elif block.type == "tool_use" and role == "assistant":
            arguments = block.input if isinstance(block.input, dict) else {}
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": arguments},
                }
            )
        elif block.type == "tool_result" and role == "user":
            flush_text()
            turns.append(
                {
                    "role": "tool",
                    "tool_call_id": block.tool_use_id,
                    "content": _tool_result_text(block),
                }
            )
        elif block.type in ("image", "document"):
            raise invalid(f"{where}: {block.type} input is not supported by this model")
        else:
            raise invalid(f"{where}: content block type {block.type!r} is not supported here")
    if role == "assistant":
        turn: chat.Message = {"role": "assistant", "content": "\n".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        return [turn]
    flush_text()
    return turns


def _system_text(system: str | list[SystemBlock] | None) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    return "\n\n".join(b.text for b in system if not b.text.startswith(BILLING_HEADER_PREFIX))


def _tools(request: _Conversation) -> list[chat.Tool]:
    tools = []
    for tool in request.tools or []:
        # Deferred tools are loaded on demand by the client (ToolSearch); server tools
        # (web_search and the like) have no schema for a local model to call.
        if tool.defer_loading or tool.input_schema is None:
            continue
        function = {
            "name": tool.name,
            "description": tool.description or "",
            "parameters": tool.input_schema,
        }
        tools.append({"type": "function", "function": function})
    return tools


def render(
    tokenizer: ChatTokenizer, fmt: chat.ChatFormat, request: _Conversation
) -> tuple[chat.Prompt, bool]:
    """The prompt for an Anthropic request, and whether tools were rendered into it."""
    messages: list[chat.Message] = []
    if system := _system_text(request.system):
        messages.append({"role": "system", "content": system})
    for index, message in enumerate(request.messages):
        messages.extend(_convert_message(index, message))
    tools = _tools(request)
    choice = (
        chat.ToolChoice(request.tool_choice.type, request.tool_choice.name)
        if request.tool_choice
        else None
    )
    thinking = None
    if request.thinking is not None:
        thinking = {"disabled": False, "enabled": True}.get(request.thinking.type)
    try:
        prompt = chat.render(
            tokenizer, fmt, messages, tools=tools, tool_choice=choice, thinking=thinking
        )
    except chat.ConversationError as exc:
        raise invalid(str(exc)) from None
    return prompt, bool(tools) and (choice is None or choice.mode != "none")


def _sampling(request: MessagesRequest, defaults: SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=defaults.temperature if request.temperature is None else request.temperature,
        top_p=defaults.top_p if request.top_p is None else request.top_p,
        top_k=defaults.top_k if request.top_k is None else request.top_k,
    )


class AnthropicAPI:
    def __init__(
        self,
        engine: Engine,
        models: ModelNames,
        default_sampling: SamplingParams,
        max_output_tokens: int | None = None,
    ) -> None:
        self.engine = engine
        self.models = models
        self.max_output_tokens = max_output_tokens
        self.default_sampling = default_sampling
        self.tokenizer = engine.loaded.tokenizer
        self.format = chat.ChatFormat.detect(self.tokenizer)

    async def messages(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        request: MessagesRequest = parse(MessagesRequest, body)
        self.models.check(request.model)
        if self.max_output_tokens is not None and request.max_tokens > self.max_output_tokens:
            # Exact wording: Claude Code parses M and retries with it.
            limit = self.max_output_tokens
            raise invalid(
                f"max_tokens: {request.max_tokens} > {limit}, which is the maximum allowed number "
                "of output tokens for this model"
            )
        prompt, with_tools = render(self.tokenizer, self.format, request)
        prompt_ids = self.tokenizer.encode(prompt.text)
        generation = GenerationRequest(
            prompt_ids, request.max_tokens, _sampling(request, self.default_sampling)
        )
        message_id = f"msg_{uuid.uuid4().hex[:24]}"
        try:
            reader = self.engine.submit(
                generation,
                lambda stream_id, cached_tokens: self.engine.router.open_anthropic(
                    stream_id,
                    model=self.models.served,
                    message_id=message_id,
                    input_tokens=len(prompt_ids) - cached_tokens,
                    cache_read_input_tokens=cached_tokens,
                    stop_sequences=request.stop_sequences or [],
                    stream=request.stream,
                    markup=self.format.markup(with_tools),
                    prefill=prompt.prefill,
                ),
            )
        except AdmissionError as exc:
            raise ApiError.from_admission(exc, "anthropic") from None
        await respond(send, receive, reader, stream=request.stream, dialect="anthropic")

    async def count_tokens(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        request: CountTokensRequest = parse(CountTokensRequest, body)
        self.models.check(request.model)
        prompt, _ = render(self.tokenizer, self.format, request)
        await send_json(send, 200, {"input_tokens": len(self.tokenizer.encode(prompt.text))})
