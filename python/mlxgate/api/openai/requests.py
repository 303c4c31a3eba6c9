"""OpenAI Chat Completions and Completions requests: validation, and conversion to a
dialect-neutral conversation."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mlxgate import prompts
from mlxgate.api import custom_tools
from mlxgate.api.errors import invalid
from mlxgate.api.images import from_url, mark
from mlxgate.api.openai_common import tool_choice
from mlxgate.api.requests import reply_grammar, sampling
from mlxgate.engine import Grammar, SamplingParams
from mlxgate.formats.reasoning import FIELD as REASONING


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Lenient):
    type: str
    text: str | None = None
    # An image_url part's: {url, detail?} (a data: URL or an http(s) one); some send the URL alone.
    image_url: dict[str, Any] | str | None = None


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class CustomCall(_Lenient):
    name: str
    input: str = ""


class ToolCall(_Lenient):
    id: str | None = None
    type: str = "function"
    function: FunctionCall | None = None
    custom: CustomCall | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # Earlier reasoning as this server (and vLLM, DeepSeek) returns it; `reasoning` as some send it.
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionSpec(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class CustomSpec(_Lenient):
    name: str
    description: str | None = None
    format: dict[str, Any] | None = None


class ToolSpec(_Lenient):
    type: Literal["function", "custom"] = "function"
    function: FunctionSpec | None = None
    custom: CustomSpec | None = None


class NamedCustom(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function", "custom"] = "function"
    function: FunctionSpec | None = None
    custom: NamedCustom | None = None


class StreamOptions(_Lenient):
    include_usage: bool = False


class JsonSchemaFormat(_Lenient):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def grammar(self) -> Grammar | None:
        schema = self.json_schema.schema_ if self.json_schema else None
        return reply_grammar(self.type, schema, "response_format")


class _Sampling(_Lenient):
    model: str | None = None  # the served model when absent, as llama-server and vLLM answer
    # How long the model stays loaded once idle (Ollama's keep_alive): seconds, or a duration
    # such as "5m"; negative: until something else unloads it.
    keep_alive: float | str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=16)  # choices, each its own sequence (prefilled once)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # mlx_lm.server's: mlx-lm's multiplicative penalty (0 or 1: off), and how many of the last
    # tokens (prompt, then reply) each penalty counts (engine/penalties.py)
    repetition_penalty: float | None = Field(default=None, ge=0.0)
    repetition_context_size: int | None = Field(default=None, ge=1)
    presence_context_size: int | None = Field(default=None, ge=1)
    frequency_context_size: int | None = Field(default=None, ge=1)
    # mlxgate's own: false keeps this request out of speculative decoding (same tokens, no guesses)
    speculative_decoding: bool = True
    # mlxgate's own: end a reply that repeats itself (default: unless temperature is 0)
    loop_guard: bool | None = None

    def sampling(self, defaults: SamplingParams) -> SamplingParams:
        return sampling(
            defaults,
            seed=self.seed,
            logprobs=self.alternatives(),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            repetition_context_size=self.repetition_context_size,
            presence_context_size=self.presence_context_size,
            frequency_context_size=self.frequency_context_size,
        )

    def alternatives(self) -> int | None:
        """How many likeliest alternatives each token's logprobs report; None: no logprobs."""
        raise NotImplementedError

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def grammar(self) -> Grammar | None:
        """What the reply's format says it must match (legacy completions have no format)."""
        return None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def alternatives(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs: logprobs must be true to use it", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def output_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def grammar(self) -> Grammar | None:
        return self.response_format.grammar() if self.response_format else None


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    max_tokens: int = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)

    def alternatives(self) -> int | None:
        return self.logprobs

    def output_tokens(self) -> int:
        return self.max_tokens


def _text(
    content: str | list[ContentPart] | None, where: str, images: list[prompts.ImageInput] | None
) -> str:
    """A message's text, its parts joined; its images (where `images` is given: a user's or a
    tool's message) added to `images`, a mark standing for each where it is."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for i, part in enumerate(content):
        at = f"{where}.content.{i}"
        if part.type == "text":
            parts.append(part.text or "")
        elif part.type == "image_url" and images is not None:
            given = part.image_url
            url = given.get("url") if isinstance(given, dict) else given
            parts.append(mark(images, from_url(url, f"{at}.image_url.url")))
        elif part.type == "image_url":
            raise invalid(f"{at}: images go in user and tool messages")
        else:
            raise invalid(f"{at}: content part type {part.type!r} is not supported")
    return "\n".join(parts)


def _arguments(function: FunctionCall, where: str) -> dict[str, Any]:
    arguments = function.arguments
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        raise invalid(f"{where}: function.arguments is not valid JSON") from None
    if not isinstance(parsed, dict):
        raise invalid(f"{where}: function.arguments must be a JSON object")
    return parsed


def _messages(
    request: ChatCompletionRequest, images: list[prompts.ImageInput]
) -> list[prompts.Message]:
    out: list[prompts.Message] = []
    for i, message in enumerate(request.messages):
        where = f"messages.{i}"
        text = _text(message.content, where, images if message.role in ("user", "tool") else None)
        if message.role in ("system", "developer"):
            out.append({"role": "system", "content": text})
        elif message.role == "tool":
            out.append({"role": "tool", "tool_call_id": message.tool_call_id, "content": text})
        elif message.role == "assistant":
            turn: prompts.Message = {"role": "assistant", "content": text}
            if reasoning := message.reasoning_content or message.reasoning:
                turn[REASONING] = reasoning
            if message.tool_calls:
                turn["tool_calls"] = [
                    _call(call, f"{where}.tool_calls.{j}")
                    for j, call in enumerate(message.tool_calls)
                ]
            out.append(turn)
        else:
            out.append({"role": message.role, "content": text})
    return prompts.merge_turns(out)


def _call(call: ToolCall, where: str) -> dict[str, Any]:
    if call.custom is not None:
        return custom_tools.call(call.id, call.custom.name, call.custom.input)
    if call.function is None:
        raise invalid(f"{where}: a tool call needs its function (or custom) object")
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": _arguments(call.function, where)},
    }


def _named_tool(choice: NamedToolChoice) -> prompts.ToolChoice:
    named = choice.custom if choice.type == "custom" else choice.function
    if named is None:
        raise invalid(f"tool_choice: a {choice.type} choice needs its {choice.type} object")
    return prompts.ToolChoice("tool", named.name)


def tools(
    request: ChatCompletionRequest,
) -> tuple[list[prompts.Tool], list[custom_tools.CustomTool]]:
    """The request's tools as the prompt shows them, and which of them are custom tools."""
    functions: list[prompts.Tool] = []
    custom: list[custom_tools.CustomTool] = []
    for i, tool in enumerate(request.tools or []):
        where = f"tools.{i}"
        if tool.type == "custom":
            if tool.custom is None:
                raise invalid(f"{where}.custom: a custom tool needs its custom object")
            spec = tool.custom
            function, given = custom_tools.custom_tool(
                spec.name, spec.description, spec.format, f"{where}.custom"
            )
            functions.append(function)
            custom.append(given)
        elif tool.function is None:
            raise invalid(f"{where}.function: a function tool needs its function object")
        else:
            functions.append(
                {"type": "function", "function": tool.function.model_dump(exclude={"strict"})}
            )
    return functions, custom


def conversation(request: ChatCompletionRequest) -> prompts.Conversation:
    functions, custom = tools(request)
    images: list[prompts.ImageInput] = []
    return prompts.Conversation(
        _messages(request, images),
        functions,
        tool_choice(request.tool_choice, _named_tool),
        structured=request.response_format is not None and request.response_format.type != "text",
        strict_tools=any(t.function and t.function.strict for t in request.tools or []),
        input_grammars=custom_tools.grammars(custom),
        custom_tools=[tool.name for tool in custom],
        images=images,
    )
