"""Dialect-neutral conversations rendered to a prompt: chat template, tools, tool-call markup.

Both APIs convert their requests to Hugging Face chat-template messages
(`{"role", "content", "tool_calls"?}`, `{"role": "tool", ...}`) and OpenAI-style function tools,
then render here, so one model gets one rendering whichever dialect asked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from mlxgate._native import Markup
from mlxgate.models.tokenizer import ChatTokenizer, TemplateError

ToolCallFormat = Literal["hermes", "mistral", "llama3_json"]
Message = dict[str, Any]
Tool = dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}

# For templates that do not render tools themselves: the Hermes / Qwen 2.5 convention, which
# small instruction-tuned models follow best and the native router parses as "hermes".
GENERIC_TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


class ConversationError(ValueError):
    """The conversation cannot be rendered (the API layer answers 400)."""


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["auto", "any", "tool", "none"] = "auto"
    name: str | None = None


@dataclass(frozen=True)
class ChatFormat:
    """How a model's template handles tools and reasoning, decided once from the template."""

    template_renders_tools: bool
    tool_call: ToolCallFormat
    think: tuple[str, str] | None
    # What the router parses: with tools declared, tool calls and thinking; without, thinking only.
    markup_tools: Markup = field(compare=False)
    markup_text: Markup | None = field(compare=False)

    def markup(self, with_tools: bool) -> Markup | None:
        return self.markup_tools if with_tools else self.markup_text

    @classmethod
    def detect(cls, tokenizer: ChatTokenizer) -> ChatFormat:
        template = tokenizer.chat_template
        if "[TOOL_CALLS]" in template:
            tool_call: ToolCallFormat = "mistral"
        elif "<|python_tag|>" in template or "ipython" in template:
            tool_call = "llama3_json"
        else:
            tool_call = "hermes"
        think = ("<think>", "</think>") if "<think>" in template else None
        return cls(
            template_renders_tools="tools" in template,
            tool_call=tool_call,
            think=think,
            markup_tools=Markup(think=think, tool_call=tool_call),
            markup_text=Markup(think=think) if think else None,
        )


@dataclass(frozen=True)
class Prompt:
    text: str
    # Markup appended after the template's generation prompt (a forced tool call's opening, an
    # opened think tag); the router parses the reply as if it had already read this.
    prefill: str


def _tool_call_text(call: dict[str, Any], fmt: ToolCallFormat) -> str:
    function = call["function"]
    body = json.dumps({"name": function["name"], "arguments": function.get("arguments", {})})
    if fmt == "mistral":
        return f"[TOOL_CALLS][{body}]"
    if fmt == "llama3_json":
        return body
    return f"<tool_call>\n{body}\n</tool_call>"


def _forced_opening(choice: ToolChoice, fmt: ToolCallFormat) -> str:
    if choice.mode == "tool":
        named = f'{{"name": {json.dumps(choice.name)}, "arguments": '
    elif choice.mode == "any":
        named = '{"name": "'
    else:
        return ""
    if fmt == "mistral":
        return f"[TOOL_CALLS][{named}"
    if fmt == "llama3_json":
        return named
    return f"<tool_call>\n{named}"


def _inline_tools(messages: list[Message], tools: list[Tool], fmt: ToolCallFormat) -> list[Message]:
    """Rewrite tool traffic as plain turns for a template that knows nothing of tools."""
    out: list[Message] = []
    if tools:
        listing = "\n".join(json.dumps(tool) for tool in tools)
        prompt = GENERIC_TOOL_PROMPT.format(tools=listing)
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": prompt})
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = "\n".join(_tool_call_text(c, fmt) for c in message["tool_calls"])
            text = message.get("content") or ""
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        elif message["role"] == "tool":
            out.append(
                {
                    "role": "user",
                    "content": f"<tool_response>\n{message['content']}\n</tool_response>",
                }
            )
        else:
            out.append({"role": message["role"], "content": message.get("content") or ""})
    return out


def merge_turns(messages: list[Message]) -> list[Message]:
    """Join consecutive same-role plain turns, so strict templates see user/assistant alternate."""
    merged: list[Message] = []
    for message in messages:
        previous = merged[-1] if merged else None
        if (
            previous is not None
            and previous["role"] == message["role"]
            and message["role"] in ("user", "assistant", "system")
            and not previous.get("tool_calls")
            and not message.get("tool_calls")
        ):
            previous["content"] = f"{previous['content']}\n\n{message['content']}"
        else:
            merged.append(dict(message))
    return merged


def render(
    tokenizer: ChatTokenizer,
    fmt: ChatFormat,
    messages: list[Message],
    *,
    tools: list[Tool] | None = None,
    tool_choice: ToolChoice | None = None,
    thinking: bool | None = None,
) -> Prompt:
    """The prompt text for `messages`; a trailing assistant turn is continued, not closed."""
    choice = tool_choice or ToolChoice()
    tools = [] if choice.mode == "none" else list(tools or [])
    if choice.mode == "tool" and choice.name not in {t["function"]["name"] for t in tools}:
        raise ConversationError(f"tool_choice names {choice.name!r}, which is not in tools")
    if choice.mode == "any" and not tools:
        raise ConversationError("tool_choice 'any' needs at least one tool")

    continuation = ""
    if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        continuation = messages[-1].get("content") or ""
        messages = messages[:-1]
    if fmt.template_renders_tools:
        turns, template_tools = merge_turns(messages), tools or None
    else:
        turns, template_tools = merge_turns(_inline_tools(messages, tools, fmt.tool_call)), None
    if not any(turn["role"] == "user" for turn in turns):
        raise ConversationError("messages: at least one user message is required")

    extra: dict[str, Any] = {}
    if thinking is not None and fmt.think is not None:
        extra["enable_thinking"] = thinking
    try:
        text = tokenizer.render(turns, tools=template_tools, add_generation_prompt=True, **extra)
    except TemplateError as exc:
        raise ConversationError(
            f"the model's chat template rejected the conversation: {exc}"
        ) from None

    prefill = ""
    if fmt.think is not None and text.rstrip().endswith(fmt.think[0]):
        prefill = text[text.rstrip().rindex(fmt.think[0]) :]  # the template opened <think>
    forced = _forced_opening(choice, fmt.tool_call) if tools else ""
    return Prompt(text=text + continuation + forced, prefill=prefill + continuation + forced)
