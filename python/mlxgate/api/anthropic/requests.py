"""Anthropic Messages requests: validation, and conversion to a dialect-neutral conversation."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mlxgate import chat
from mlxgate.api import compaction
from mlxgate.api.errors import invalid
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
    content: str | list[ContentBlock] | None = None
    is_error: bool | None = None
    tool_name: str | None = None
    thinking: str | None = None


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
    strict: bool | None = None


class ToolChoiceSpec(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class ThinkingSpec(_Lenient):
    type: str


class OutputFormat(_Lenient):
    type: Literal["json_schema"]
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class OutputConfig(_Lenient):
    format: OutputFormat | None = None


class ContextManagement(_Lenient):
    edits: list[dict[str, Any]] = Field(default_factory=list)


class CountTokensRequest(_Lenient):
    model: str
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

    def output_tokens(self) -> int:
        return self.max_tokens

    def sampling(self, defaults: SamplingParams) -> SamplingParams:
        return sampling(defaults, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


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
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []

    def flush_text() -> None:
        if texts:
            turns.append({"role": role, "content": "\n".join(texts)})
            texts.clear()

    for i, block in enumerate(message.content):
        where = f"messages.{index}.content.{i}"
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "thinking" and role == "assistant":
            # Replayed where the model's template reads earlier reasoning (see formats.reasoning).
            reasoning.append(block.thinking or "")
        elif block.type in ("thinking", "redacted_thinking"):
            continue  # redacted reasoning has no text a local model wrote
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
        if any(reasoning):
            turn[REASONING] = "\n\n".join(r for r in reasoning if r)
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


def _tools(request: CountTokensRequest) -> list[chat.Tool]:
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


def conversation(request: CountTokensRequest) -> chat.Conversation:
    messages: list[chat.Message] = []
    if system := _system_text(request.system):
        messages.append({"role": "system", "content": system})
    for index, message in _since_compaction(request.messages):
        messages.extend(_convert_message(index, message))
    choice = request.tool_choice
    thinking = None
    if request.thinking is not None:
        thinking = {"disabled": False, "enabled": True}.get(request.thinking.type)
    return chat.Conversation(
        messages=messages,
        tools=_tools(request),
        tool_choice=chat.ToolChoice(choice.type, choice.name) if choice else chat.ToolChoice(),
        thinking=thinking,
        structured=request.reply_format() is not None,
        strict_tools=any(tool.strict for tool in request.tools or []),
    )
