"""Dialect-neutral conversations rendered to a prompt: chat template, tools, tool-call markup.

Every API converts its requests to a `Conversation` of Hugging Face chat-template messages
(`{"role", "content", "tool_calls"?}`, `{"role": "tool", ...}`) and OpenAI-style function tools,
then renders it here, so one model gets one rendering whichever dialect asked.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from mlxgate import formats
from mlxgate._native import Markup, Reply
from mlxgate.formats import ToolFormat
from mlxgate.formats.call_grammar import AddedTokens, forced_call, optional_calls
from mlxgate.formats.reasoning import FIELD as REASONING
from mlxgate.models.tokenizer import ChatTokenizer, TemplateError

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

    from mlxgate.engine.contract import PromptImages

Message = dict[str, Any]
Tool = dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}


class ConversationError(ValueError):
    """The conversation cannot be rendered (the API layer answers 400)."""


# An image's place in a conversation's text: its index in `Conversation.images` between two
# private-use characters. Templates, turn merging and tool results all handle it as text; once
# rendered, a vision model's own placeholder replaces it (api/vision_prompts.py).
IMAGE_MARK = re.compile("\ue000image (\\d+)\ue001")


def image_mark(index: int) -> str:
    return f"\ue000image {index}\ue001"


@dataclass(frozen=True)
class ImageInput:
    """An image as a request gave it: the file's bytes, or a URL the server fetches (only with
    --allow-image-urls)."""

    where: str  # the request field it came in (for errors)
    data: bytes | None = None
    url: str | None = None
    media_type: str | None = None  # as the request declared it


@dataclass(frozen=True)
class LoadedImage:
    """An image decoded (api/images.py)."""

    image: PILImage  # RGB
    digest: bytes  # sha256 of the file as sent


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["auto", "any", "tool", "none"] = "auto"
    name: str | None = None


@dataclass
class Conversation:
    """A request in no dialect's shape: Hugging Face chat-template messages and function tools."""

    messages: list[Message]
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    thinking: bool | None = None
    # The reply is held to a grammar from its first token (constrained decoding): no reasoning.
    structured: bool = False
    # A tool is `strict`: the calls the model chooses to make are held to their schemas.
    strict_tools: bool = False
    # Custom tools' input grammars (llguidance Lark), by tool name: a call's input is held to
    # its tool's grammar (where the tool format writes the input as raw text).
    input_grammars: dict[str, str] = field(default_factory=dict)
    # The tools that are custom tools (raw text input): the reply answers calls to them so.
    custom_tools: list[str] = field(default_factory=list)
    # Tools the model may call that the prompt's tool list leaves out: their definitions reached
    # it inside the conversation (a tool search's result). Listing them would change the
    # prompt's opening each time a tool is found, and with it every cached prefix.
    loaded_tools: list[Tool] = field(default_factory=list)
    # The images the messages' text marks (`image_mark(i)` stands for images[i]).
    images: list[ImageInput] = field(default_factory=list)


def markup(tool_call: str | None, think: tuple[str, str] | None) -> Markup | None:
    """What the router parses: the one place a `Markup` is built from format names (every name
    in `formats.TOOL_FORMATS` has its parser in `rust/markup/`)."""
    if tool_call is None and think is None:
        return None
    return Markup(think=think, tool_call=tool_call)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ChatFormat:
    """How a model's template handles tools and reasoning, decided once from the template
    (a format named in the settings overrides the detected one)."""

    template_renders_tools: bool
    # Renders earlier calls and results, whether or not it lists the tools (DeepSeek V3.1 does not).
    template_renders_calls: bool
    tool_format: ToolFormat
    reasoning: formats.ReasoningFormat
    # What the router parses: with tools declared, tool calls and thinking; without, thinking only
    # (harmony's channels are one format: its parser reads them with or without tools).
    markup_tools: Markup | None = field(compare=False)
    markup_text: Markup | None = field(compare=False)

    @property
    def think(self) -> tuple[str, str] | None:
        return self.reasoning.tags

    @classmethod
    def detect(
        cls, template: str, tool_format: str | None = None, reasoning_format: str | None = None
    ) -> ChatFormat:
        tools = (
            formats.TOOL_FORMATS[tool_format]
            if tool_format
            else formats.detect_tool_format(template)
        )
        reasoning = (
            formats.REASONING_FORMATS[reasoning_format]
            if reasoning_format
            else formats.detect_reasoning_format(template)
        )
        always = tools.NAME if reasoning.name == "harmony" == tools.NAME else None
        return cls(
            template_renders_tools="tools" in template,
            template_renders_calls="tool_calls" in template,
            tool_format=tools,
            reasoning=reasoning,
            markup_tools=markup(tools.NAME, reasoning.tags),
            markup_text=markup(always, reasoning.tags),
        )


@dataclass(frozen=True)
class Prompt:
    text: str
    ids: list[int]
    # How the reply reads (markup, what of it the prompt already holds, end-of-turn tokens,
    # tools): what every dialect's stream is opened with.
    reply: Reply
    # What the reply may be after a forced call's opening (llguidance Lark): the rest of one call
    # whose arguments validate against the tool's schema. None: unconstrained.
    call_grammar: str | None = None
    # Where the model's image tokens are in `ids`, and what it sees there (vision models only).
    images: PromptImages | None = None


def _with_tool_prompt(messages: list[Message], tools: list[Tool], fmt: ToolFormat) -> list[Message]:
    """The tools listed in the system message, for a template that does not list them."""
    if not tools:
        return messages
    prompt = formats.tool_prompt(fmt, tools)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _inline_tools(messages: list[Message], tools: list[Tool], fmt: ToolFormat) -> list[Message]:
    """Rewrite tool traffic as plain turns for a template that knows nothing of tools."""
    out: list[Message] = []
    for message in _with_tool_prompt(messages, tools, fmt):
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = "\n".join(
                fmt.render_call(c["function"]["name"], c["function"].get("arguments", {}))
                for c in message["tool_calls"]
            )
            text = message.get("content") or ""
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        elif message["role"] == "tool":
            out.append({"role": "user", "content": fmt.tool_result(message["content"])})
        else:
            out.append({"role": message["role"], "content": message.get("content") or ""})
    return out


def _system_reminder(text: str) -> str:
    """A system message as user text, for templates that take a system message only first
    (Claude Code's own wrapping of system text inside user turns)."""
    return f"<system-reminder>\n{text}\n</system-reminder>"


def _system_in_place(messages: list[Message], anywhere: bool) -> list[Message]:
    """System messages after the conversation's first other turn, where they stand: as system
    turns where the template renders them there, else as user turns of `_system_reminder` text.
    Never moved into the first system message, which would change every turn's prefix."""
    if anywhere:
        return messages
    out: list[Message] = []
    opened = False
    for message in messages:
        if message["role"] != "system":
            opened = True
        elif opened:
            message = {"role": "user", "content": _system_reminder(message.get("content") or "")}
        out.append(message)
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
            and not any(
                m.get(key) for m in (previous, message) for key in ("tool_calls", REASONING)
            )
        ):
            previous["content"] = f"{previous['content']}\n\n{message['content']}"
        else:
            merged.append(dict(message))
    return merged


def with_arguments_as_json(messages: list[Message]) -> list[Message]:
    """Tool-call arguments as JSON text, for templates that print them rather than iterate them."""
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [
                {**c, "function": {**c["function"], "arguments": json.dumps(args)}}
                if not isinstance(args := c["function"].get("arguments", {}), str)
                else c
                for c in message["tool_calls"]
            ]
            message = {**message, "tool_calls": calls}
        out.append(message)
    return out


class Renderer:
    """One model's prompt rendering, shared by every API dialect: the chat template, its tool
    and reasoning format, the tokenizer."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        tool_format: str | None = None,
        reasoning_format: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.format = ChatFormat.detect(tokenizer.chat_template, tool_format, reasoning_format)
        self.eos_ids = sorted(tokenizer.eos_ids | self._turn_end_ids())
        self.arguments_as_json = False
        self.arguments_as_json = self.format.template_renders_calls and self._prints_arguments()
        self.added_tokens = AddedTokens.of(tokenizer.tokenizer)
        self.system_anywhere = self._renders_system_in_place()

    def _renders_system_in_place(self) -> bool:
        """Whether the template renders a system message after other turns where it stands
        (Qwen3, GLM, Kimi K2) rather than refusing it (Qwen3.5), dropping it (gpt-oss,
        MiniMax M2) or moving it first (DeepSeek V3.1)."""
        turns: list[Message] = [
            {"role": role, "content": f"MLXGATE_{role.upper()}_PROBE_{i}"}
            for i, role in enumerate(("user", "system", "assistant", "user"))
        ]
        parameters = {"type": "object", "properties": {"probe": {"type": "string"}}}
        tool = {
            "type": "function",
            "function": {"name": "probe", "description": "probe", "parameters": parameters},
        }
        # Claude Code's first request and a later one, with tools and without.
        for shape, tools in itertools.product((turns[:2], turns), (None, [tool])):
            try:
                text = self.tokenizer.render(shape, tools=tools, add_generation_prompt=True)
            except Exception:  # the template refuses it
                return False
            places = [text.find(turn["content"]) for turn in shape]
            if -1 in places or places != sorted(places):
                return False
        return True

    def _turn_end_ids(self) -> set[int]:
        """The special token the template closes an assistant turn with (`<|im_end|>`,
        `<|eot_id|>`, ...): a model ends its reply with it even where the tokenizer's
        `eos_token` is another. Not for harmony, whose `<|end|>` also ends an analysis message
        in the middle of a reply (its reply ends with `<|return|>` or `<|call|>`, which
        generation_config.json lists)."""
        if self.format.tool_format.NAME == "harmony":
            return set()
        marker = "MLXGATE_TURN_PROBE"
        turns: list[Message] = [
            {"role": "user", "content": "probe"},
            {"role": "assistant", "content": marker},
        ]
        try:
            text = self.tokenizer.render(turns, add_generation_prompt=False)
        except Exception:  # a template that wants another conversation: nothing learned
            return set()
        if marker not in text:
            return set()
        after = self.tokenizer.encode(text[text.rindex(marker) + len(marker) :].lstrip(" "))
        special = self.tokenizer.special_ids
        return {after[0]} if after and after[0] in special else set()

    def _prints_arguments(self) -> bool:
        """Whether the template prints a call's arguments as given (it then needs JSON text)
        rather than iterating or serialising them (it then needs an object)."""
        arguments = {"probe_key": "probe_value"}
        call = {
            "id": "probe",
            "type": "function",
            "function": {"name": "probe", "arguments": arguments},
        }
        probe: list[Message] = [
            {"role": "user", "content": "probe"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "probe", "content": "probe"},
        ]
        try:
            text = self.tokenizer.render(self._shaped(probe), add_generation_prompt=True)
        except Exception:  # the probe is not the conversation this template wants: assume objects
            return False
        return "{'probe_key'" in text

    def _shaped(self, turns: list[Message]) -> list[Message]:
        """Neutral turns in the shape the template reads: reasoning where it looks for it, calls
        as its format lays them out, arguments as object or text."""
        turns = self.format.reasoning.prepare(turns)
        turns = self.format.tool_format.prepare(turns)
        return with_arguments_as_json(turns) if self.arguments_as_json else turns

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def render(self, conversation: Conversation) -> Prompt:
        """The prompt for `conversation`; a trailing assistant turn is continued, not closed."""
        fmt = self.format
        choice = conversation.tool_choice
        tools = [] if choice.mode == "none" else list(conversation.tools)
        # What the model may call: the listed tools and those the conversation loaded.
        callable_tools = [] if choice.mode == "none" else [*tools, *conversation.loaded_tools]
        names = {tool["function"]["name"] for tool in callable_tools}
        if choice.mode == "tool" and choice.name not in names:
            raise ConversationError(f"tool_choice names {choice.name!r}, which is not in tools")
        if choice.mode == "any" and not callable_tools:
            raise ConversationError("tool_choice 'any' needs at least one tool")

        messages = _system_in_place(conversation.messages, self.system_anywhere)
        continuation = ""
        if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
            continuation = messages[-1].get("content") or ""
            messages = messages[:-1]
        if fmt.template_renders_tools:
            turns, template_tools = self._shaped(merge_turns(messages)), tools or None
        elif fmt.template_renders_calls:
            turns = self._shaped(merge_turns(_with_tool_prompt(messages, tools, fmt.tool_format)))
            template_tools = None
        else:
            turns = merge_turns(_inline_tools(messages, tools, fmt.tool_format))
            template_tools = None
        if not any(turn["role"] == "user" for turn in turns):
            raise ConversationError("messages: at least one user message is required")

        extra: dict[str, Any] = {}
        thinking = False if conversation.structured else conversation.thinking
        if thinking is not None and fmt.think is not None:
            extra["enable_thinking"] = thinking
        try:
            text = self.tokenizer.render(
                turns, tools=template_tools, add_generation_prompt=True, **extra
            )
        except TemplateError as exc:
            raise ConversationError(
                f"the model's chat template rejected the conversation: {exc}"
            ) from None

        prefill = ""
        if fmt.think is not None and text.rstrip().endswith(fmt.think[0]):
            prefill = text[text.rstrip().rindex(fmt.think[0]) :]  # the template opened <think>
        forced, call_grammar, answer = "", None, fmt.reasoning.answer
        if callable_tools and choice.mode in ("any", "tool"):
            name = choice.name if choice.mode == "tool" else None
            forced = fmt.tool_format.forced_opening(name)
            call_grammar = forced_call(
                fmt.tool_format,
                callable_tools,
                name,
                self.added_tokens,
                conversation.input_grammars,
            )
        elif (
            callable_tools
            and (conversation.strict_tools or conversation.input_grammars)
            and not (conversation.structured or answer)
        ):
            # (Where the answer has an opening, harmony's `<|channel|>`, calls open with it too:
            # free text around calls could not hold it.)
            call_grammar = optional_calls(
                fmt.tool_format, callable_tools, self.added_tokens, conversation.input_grammars
            )
        if conversation.structured and not forced:
            forced = answer  # the answer at once, with no reasoning before it
        if (forced or conversation.structured) and prefill and fmt.think is not None:
            # A forced call or a structured reply does not reason: close what the template opened.
            text, prefill = f"{text.rstrip()}\n\n{fmt.think[1]}\n\n", ""
        text += continuation + forced
        reply = Reply(
            markup=fmt.markup_tools if callable_tools else fmt.markup_text,
            prefill=prefill + continuation + forced,
            eos_ids=self.eos_ids,
            tools=[
                (tool["function"]["name"], json.dumps(tool["function"].get("parameters") or {}))
                for tool in callable_tools
            ],
        )
        return Prompt(text, self.tokenizer.encode(text), reply, call_grammar)

    def plain(self, text: str) -> Prompt:
        """A prompt given as text, no template (legacy completions): its reply is plain text."""
        return Prompt(text, self.tokenizer.encode(text), Reply(eos_ids=self.eos_ids))
