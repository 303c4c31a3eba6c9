"""The Anthropic Messages API: request validation, prompt rendering, responses and errors."""

from __future__ import annotations

import uuid
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mlxgate.api.http import Receive, Scope, Send, collect, send_bytes, send_event_stream, send_json
from mlxgate.engine import AdmissionError, Engine, GenerationRequest, QueueFull, SamplingParams
from mlxgate.models.tokenizer import ChatTokenizer, TemplateError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

# Claude Code sends a per-session block that would defeat prefix reuse; it carries no instructions.
BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"


class InvalidRequest(ValueError):
    pass


def error_body(status: int, message: str) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message},
    }


async def send_error(
    send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await send_json(send, status, error_body(status, message), extra_headers=headers)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class InputMessage(_Lenient):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class SystemBlock(_Lenient):
    type: Literal["text"]
    text: str


class MessagesRequest(_Lenient):
    model: str
    messages: list[InputMessage]
    max_tokens: int = Field(ge=1)
    system: str | list[SystemBlock] | None = None
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)


class CountTokensRequest(_Lenient):
    model: str
    messages: list[InputMessage]
    system: str | list[SystemBlock] | None = None


def _validation_message(exc: ValidationError) -> str:
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}" if where else first["msg"]


def parse(model: type[BaseModel], body: bytes) -> Any:
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise InvalidRequest(_validation_message(exc)) from None


def _text_of(content: str | list[ContentBlock], where: str) -> str:
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for i, block in enumerate(content):
        if block.type == "text":
            parts.append(block.text or "")
        elif block.type in ("thinking", "redacted_thinking"):
            continue  # earlier reasoning is not replayed into the prompt
        elif block.type == "image":
            raise InvalidRequest(f"{where}.content.{i}: images are not supported by this model")
        else:
            raise InvalidRequest(
                f"{where}.content.{i}: content block type {block.type!r} is not supported"
            )
    return "\n".join(parts)


def _system_text(system: str | list[SystemBlock] | None) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    blocks = [b.text for b in system if not b.text.startswith(BILLING_HEADER_PREFIX)]
    return "\n\n".join(blocks)


def build_prompt(
    tokenizer: ChatTokenizer, system: str | list[SystemBlock] | None, messages: list[InputMessage]
) -> str:
    """Render the conversation with the model's chat template.

    `role: "system"` messages (Claude Code sends them inside `messages`) become user turns, then
    consecutive same-role turns merge so any template sees a strict alternation. A trailing
    assistant turn is a prefill: the reply continues it.
    """
    turns: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        text = _text_of(message.content, f"messages.{i}")
        role = "user" if message.role == "system" else message.role
        if not text and message.role == "system":
            continue
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"] += "\n\n" + text
        else:
            turns.append({"role": role, "content": text})
    prefill = ""
    if turns and turns[-1]["role"] == "assistant":
        prefill = turns.pop()["content"]
    if not turns:
        raise InvalidRequest("messages: at least one user message is required")
    system_text = _system_text(system)
    if system_text:
        turns.insert(0, {"role": "system", "content": system_text})
    try:
        return tokenizer.render(turns, add_generation_prompt=True) + prefill
    except TemplateError as exc:
        raise InvalidRequest(
            f"the model's chat template rejected the conversation: {exc}"
        ) from None


def _sampling(request: MessagesRequest, defaults: SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=defaults.temperature if request.temperature is None else request.temperature,
        top_p=defaults.top_p if request.top_p is None else request.top_p,
        top_k=defaults.top_k if request.top_k is None else request.top_k,
    )


class AnthropicAPI:
    def __init__(self, engine: Engine, model_name: str, default_sampling: SamplingParams) -> None:
        self.engine = engine
        self.default_sampling = default_sampling
        self.tokenizer = engine.loaded.tokenizer
        self.model_name = model_name

    def _prompt_ids(self, system: Any, messages: list[InputMessage]) -> list[int]:
        return self.tokenizer.encode(build_prompt(self.tokenizer, system, messages))

    async def messages(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        request: MessagesRequest = parse(MessagesRequest, body)
        prompt_ids = self._prompt_ids(request.system, request.messages)
        generation = GenerationRequest(
            prompt_ids, request.max_tokens, _sampling(request, self.default_sampling)
        )
        message_id = f"msg_{uuid.uuid4().hex[:24]}"
        try:
            reader = self.engine.submit(
                generation,
                lambda stream_id, cached_tokens: self.engine.router.open_anthropic(
                    stream_id,
                    model=self.model_name,
                    message_id=message_id,
                    input_tokens=len(prompt_ids) - cached_tokens,
                    cache_read_input_tokens=cached_tokens,
                    stop_sequences=request.stop_sequences or [],
                    stream=request.stream,
                ),
            )
        except QueueFull as exc:
            await send_error(
                send, exc.status, str(exc), [(b"retry-after", str(exc.retry_after_s).encode())]
            )
            return
        except AdmissionError as exc:
            await send_error(send, exc.status, str(exc))
            return
        if request.stream:
            await send_event_stream(send, receive, reader)
            return
        body_out = await collect(receive, reader)
        if body_out is None:
            return
        status = 500 if body_out.startswith(b'{"type":"error"') else 200
        await send_bytes(send, status, body_out)

    async def count_tokens(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        request: CountTokensRequest = parse(CountTokensRequest, body)
        await send_json(
            send, 200, {"input_tokens": len(self._prompt_ids(request.system, request.messages))}
        )
