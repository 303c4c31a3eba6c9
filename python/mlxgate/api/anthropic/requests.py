"""Anthropic Messages requests: validation, and conversion to a dialect-neutral conversation."""

from __future__ import annotations

from itertools import groupby
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mlxgate import prompts
from mlxgate.api import compaction
from mlxgate.api.anthropic.tool_search import Toolset
from mlxgate.api.errors import invalid
from mlxgate.api.images import decode_base64, from_url, mark
from mlxgate.api.requests import reply_grammar, sampling
from mlxgate.engine import Grammar, SamplingParams
from mlxgate.formats.reasoning import FIELD as REASONING

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
    # A tool result's: text or blocks; a tool search result's: one block (found or error).
    content: str | list[ContentBlock] | ContentBlock | None = None
    is_error: bool | None = None
    tool_name: str | None = None
    thinking: str | None = None
    tool_references: list[ContentBlock] | None = None
    error_code: str | None = None
    error_message: str | None = None
    # An image's: {type: "base64", media_type, data} or {type: "url", url}.
    source: dict[str, Any] | None = None


class InputMessage(_Lenient):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]
    # Claude Code's, on its system messages.
    output_config: OutputConfig | None = None


class SystemBlock(_Lenient):
    type: Literal["text"]
    text: str


class ToolSpec(_Lenient):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    defer_loading: bool = False
    strict: bool | None = None


class ToolChoiceSpec(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class ThinkingSpec(_Lenient):
    # "enabled", "disabled", or "adaptive": as the model's template does by default.
    type: str
    budget_tokens: int | None = None
    # Accepted; thinking is shown whatever it says.
    display: str | None = None


class OutputFormat(_Lenient):
    type: Literal["json_schema"]
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class OutputConfig(_Lenient):
    format: OutputFormat | None = None
    # "low" turns thinking off where the template has a switch and thinking is not "enabled".
    effort: str | None = None


class ContextManagement(_Lenient):
    edits: list[dict[str, Any]] = Field(default_factory=list)


class CountTokensRequest(_Lenient):
    model: str
    # How long the model stays loaded once idle (Ollama's keep_alive): seconds, or a duration
    # such as "5m"; negative: until something else unloads it.
    keep_alive: float | str | None = None
    messages: list[InputMessage]
    system: str | list[SystemBlock] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoiceSpec | None = None
    thinking: ThinkingSpec | None = None
    output_config: OutputConfig | None = None
    # Where the structured-outputs-2025-11-13 beta put the reply's format.
    output_format: OutputFormat | None = None
    context_management: ContextManagement | None = None
    # `{"type": "summarize", "instructions"?}`: answer with a compaction of the conversation.
    compaction: dict[str, Any] | None = None

    def reply_format(self) -> tuple[str, OutputFormat] | None:
        """The reply's format and the field it came in: `output_config.format`, or the beta's."""
        if self.output_config and self.output_config.format:
            return "output_config.format", self.output_config.format
        return ("output_format", self.output_format) if self.output_format else None

    def grammar(self) -> Grammar | None:
        """What the reply must match: the JSON schema of its format, if it has one."""
        if (given := self.reply_format()) is None:
            return None
        where, reply = given
        return reply_grammar(reply.type, reply.schema_, where)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    # mlxgate's own: false keeps this request out of speculative decoding (same tokens, no guesses)
    speculative_decoding: bool = True
    # mlxgate's own: end a reply that repeats itself (default: unless temperature is 0)
    loop_guard: bool | None = None

    def output_tokens(self) -> int:
        return self.max_tokens

    def sampling(self, defaults: SamplingParams) -> SamplingParams:
        return sampling(defaults, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


def _image(block: ContentBlock, where: str, images: list[prompts.ImageInput]) -> str:
    """An image block added to `images`: the mark standing for it in the text."""
    source = block.source or {}
    kind = source.get("type")
    if kind == "base64":
        data = decode_base64(source.get("data"), f"{where}.source.data")
        media_type = source.get("media_type")
        return mark(images, prompts.ImageInput(where, data=data, media_type=media_type))
    if kind == "url":
        return mark(images, from_url(source.get("url"), f"{where}.source.url"))
    if kind == "file":
        raise invalid(f"{where}.source: images by file_id need a file store; this server has none")
    raise invalid(f"{where}.source.type: {kind!r} is not an image source (base64 or url)")


def _tool_result_text(
    block: ContentBlock, toolset: Toolset, where: str, images: list[prompts.ImageInput]
) -> str:
    if isinstance(block.content, str) or block.content is None:
        text = block.content or ""
    elif isinstance(block.content, ContentBlock):
        raise invalid("a tool_result's content is text or a list of blocks")
    else:
        parts: list[str] = []
        # A run of tool_reference blocks (a client's search result) is one <functions> block.
        numbered = enumerate(block.content)
        for references, run in groupby(numbered, lambda n: n[1].type == "tool_reference"):
            if references:
                parts.append(toolset.found([inner.tool_name or "" for _, inner in run]))
                continue
            for i, inner in run:
                if inner.type == "text":
                    parts.append(inner.text or "")
                elif inner.type == "image":
                    parts.append(_image(inner, f"{where}.content.{i}", images))
        text = "\n".join(parts)
    return f"Error: {text}" if block.is_error else text


def _search_result_text(block: ContentBlock, toolset: Toolset) -> str:
    """A `tool_search_tool_result` as the search tool's result: the tools found, or the error."""
    result = block.content
    if not isinstance(result, ContentBlock):
        raise invalid("a tool_search_tool_result's content is one block")
    if result.type == "tool_search_tool_result_error":
        detail = f": {result.error_message}" if result.error_message else ""
        return f"Error: {result.error_code}{detail}"
    return toolset.found([ref.tool_name or "" for ref in result.tool_references or []])


def _convert_message(
    index: int, message: InputMessage, toolset: Toolset, images: list[prompts.ImageInput]
) -> list[prompts.Message]:
    """One Anthropic message as chat-template turns: tool results become `tool` turns, and so
    does a server tool search's result inside an assistant message (after its call). A system
    message stays a system turn where it stands (prompts.Renderer places it). A user message's
    images go to `images`, their marks into its text where they stand."""
    role = message.role
    if isinstance(message.content, str):
        return (
            [{"role": role, "content": message.content}]
            if message.content or role == "assistant"
            else []
        )
    turns: list[prompts.Message] = []
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []

    def flush_text() -> None:
        if texts:
            turns.append({"role": role, "content": "\n".join(texts)})
            texts.clear()

    def flush_assistant() -> None:
        turn: prompts.Message = {"role": "assistant", "content": "\n".join(texts)}
        if any(reasoning):
            turn[REASONING] = "\n\n".join(r for r in reasoning if r)
        if calls:
            turn["tool_calls"] = list(calls)
        turns.append(turn)
        texts.clear()
        reasoning.clear()
        calls.clear()

    for i, block in enumerate(message.content):
        where = f"messages.{index}.content.{i}"
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "thinking" and role == "assistant":
            # Replayed where the model's template reads earlier reasoning (see formats.reasoning).
            reasoning.append(block.thinking or "")
        elif block.type in ("thinking", "redacted_thinking"):
            continue  # redacted reasoning has no text a local model wrote
        elif role == "assistant" and (
            block.type == "tool_use"
            or (block.type == "server_tool_use" and toolset.is_search(block.name))
        ):
            arguments = block.input if isinstance(block.input, dict) else {}
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": arguments},
                }
            )
        elif block.type == "tool_search_tool_result" and role == "assistant":
            flush_assistant()
            text = _search_result_text(block, toolset)
            turns.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
        elif block.type == "tool_result" and role == "user":
            flush_text()
            turns.append(
                {
                    "role": "tool",
                    "tool_call_id": block.tool_use_id,
                    "content": _tool_result_text(block, toolset, where, images),
                }
            )
        elif block.type == "image" and role == "user":
            texts.append(_image(block, where, images))
        elif block.type == "image":
            raise invalid(f"{where}: images go in user messages (and tool results)")
        elif block.type == "document":
            raise invalid(f"{where}: document input is not supported by this model")
        else:
            raise invalid(f"{where}: content block type {block.type!r} is not supported here")
    if role == "assistant":
        if texts or reasoning or calls or not turns:
            flush_assistant()
        return turns
    flush_text()
    return turns


def _referenced_tools(messages: list[InputMessage]) -> list[str]:
    """The tools the conversation's tool searches found: `tool_reference` blocks in tool
    results (a client's search, Claude Code's ToolSearch) and in server search results."""
    names: list[str] = []
    for message in messages:
        for block in message.content if isinstance(message.content, list) else []:
            content = block.content
            if block.type == "tool_result" and isinstance(content, list):
                names += [b.tool_name or "" for b in content if b.type == "tool_reference"]
            elif block.type == "tool_search_tool_result" and isinstance(content, ContentBlock):
                names += [b.tool_name or "" for b in content.tool_references or []]
    return names


def _system_text(system: str | list[SystemBlock] | None) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    return "\n\n".join(b.text for b in system if not b.text.startswith(BILLING_HEADER_PREFIX))


def _thinking(request: CountTokensRequest) -> bool | None:
    """Whether the model thinks: as asked ("enabled", "disabled"), else as its template does
    ("adaptive", or nothing said), except that "low" effort turns it off. The effort is the
    request's `output_config`, else the last message's (Claude Code's system messages)."""
    asked = request.thinking.type if request.thinking else None
    if asked in ("enabled", "disabled"):
        return asked == "enabled"
    efforts = [
        m.output_config.effort
        for m in request.messages
        if m.output_config and m.output_config.effort
    ]
    effort = (request.output_config.effort if request.output_config else None) or (
        efforts[-1] if efforts else None
    )
    return False if effort == "low" else None


def _since_compaction(messages: list[InputMessage]) -> list[tuple[int, InputMessage]]:
    """The messages a request's last `compaction` block leaves (with their indexes): the block
    stands for everything before it, as its summary in a user turn (a block without content, a
    failed compaction, stands for nothing)."""
    numbered = list(enumerate(messages))
    for position in range(len(numbered) - 1, -1, -1):
        index, message = numbered[position]
        blocks = message.content if isinstance(message.content, list) else []
        last = max((i for i, b in enumerate(blocks) if b.type == "compaction"), default=None)
        if last is None:
            continue
        summary = blocks[last].content
        if not isinstance(summary, str):
            return numbered[position + 1 :]
        rest = InputMessage(role=message.role, content=blocks[last + 1 :])
        replaced = InputMessage(role="user", content=compaction.replaced(summary)["content"])
        kept = [(index, replaced), *([(index, rest)] if rest.content else [])]
        return [*kept, *numbered[position + 1 :]]
    return numbered


def conversation(request: CountTokensRequest) -> prompts.Conversation:
    toolset = Toolset.of(request.tools or [])
    messages: list[prompts.Message] = []
    images: list[prompts.ImageInput] = []
    if system := _system_text(request.system):
        messages.append({"role": "system", "content": system})
    for index, message in _since_compaction(request.messages):
        messages.extend(_convert_message(index, message, toolset, images))
    choice = request.tool_choice
    return prompts.Conversation(
        messages=messages,
        tools=toolset.listed,
        tool_choice=prompts.ToolChoice(choice.type, choice.name)
        if choice
        else prompts.ToolChoice(),
        thinking=_thinking(request),
        structured=request.reply_format() is not None,
        strict_tools=any(tool.strict for tool in request.tools or []),
        loaded_tools=toolset.loaded(_referenced_tools(request.messages)),
        images=images,
    )
