"""OpenAI Responses requests: validation, and conversion of `instructions`, `input` items and
tools to a dialect-neutral conversation."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mlxgate import prompts
from mlxgate._native import compaction_from_encrypted, reasoning_from_encrypted
from mlxgate.api import compaction, custom_tools
from mlxgate.api.errors import invalid
from mlxgate.api.images import from_url, mark
from mlxgate.api.openai_common import tool_choice
from mlxgate.api.requests import reply_grammar, sampling
from mlxgate.engine import Grammar, SamplingParams
from mlxgate.formats.reasoning import FIELD as REASONING

log = logging.getLogger("mlxgate")

# What a namespaced function is called in the prompt: `namespace` + this + `name`.
NAMESPACE_SEPARATOR = "__"


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Item(BaseModel):
    """Any input item; the fields of the types mlxgate understands are typed. Unknown fields are
    kept, so an item stored for `previous_response_id` replays whole."""

    model_config = ConfigDict(extra="allow")
    type: str = "message"  # an "easy" input message has no type
    role: str | None = None
    content: str | list[dict[str, Any]] | None = None
    call_id: str | None = None
    name: str | None = None
    namespace: str | None = None
    arguments: str | None = None
    input: str | None = None  # a custom tool call's
    output: str | list[dict[str, Any]] | None = None
    summary: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None


class Reasoning(_Lenient):
    effort: str | None = None
    summary: str | None = None


class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextSettings(_Lenient):
    format: TextFormat | None = None


class ResponsesRequest(_Lenient):
    model: str | None = None  # the served model when absent
    # How long the model stays loaded once idle (Ollama's keep_alive): seconds, or a duration
    # such as "5m"; negative: until something else unloads it.
    keep_alive: float | str | None = None
    input: str | list[Item]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # mlxgate's own: false keeps this request out of speculative decoding (same tokens, no guesses)
    speculative_decoding: bool = True
    # mlxgate's own: end a reply that repeats itself (default: unless temperature is 0)
    loop_guard: bool | None = None
    stream: bool = False
    store: bool = True  # OpenAI's default
    previous_response_id: str | None = None
    include: list[str] | None = None
    reasoning: Reasoning | None = None
    text: TextSettings | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = None

    @property
    def items(self) -> list[Item]:
        if isinstance(self.input, str):
            return [Item(type="message", role="user", content=self.input)]
        return self.input

    @property
    def compacting(self) -> bool:
        """The input ends with `compaction_trigger`: the answer is a compaction of the
        conversation (Codex's remote compaction)."""
        items = self.items
        return bool(items) and items[-1].type == "compaction_trigger"

    @property
    def encrypted_reasoning(self) -> bool:
        return "reasoning.encrypted_content" in (self.include or [])

    @property
    def reasoning_summary(self) -> bool:
        summary = self.reasoning.summary if self.reasoning else None
        return summary not in (None, "none")

    @property
    def text_format(self) -> str:
        return self.text.format.type if self.text and self.text.format else "text"

    def output_tokens(self) -> int | None:
        return self.max_output_tokens

    def sampling(self, defaults: SamplingParams) -> SamplingParams:
        return sampling(defaults, temperature=self.temperature, top_p=self.top_p, top_k=None)

    def grammar(self) -> Grammar | None:
        schema = self.text.format.schema_ if self.text and self.text.format else None
        return reply_grammar(self.text_format, schema, "text.format")

    def echo(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        """The settings every Response object repeats, as OpenAI's API returns them."""
        reasoning = self.reasoning or Reasoning()
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id,
            "reasoning": {"effort": reasoning.effort, "summary": reasoning.summary},
            "store": self.store,
            "temperature": self.temperature,
            "text": {"format": {"type": self.text_format}},
            "tool_choice": self.tool_choice or "auto",
            "tools": tools,
            "top_p": self.top_p,
            "truncation": self.truncation or "disabled",
            "user": self.user,
            "metadata": self.metadata or {},
        }


@dataclass(frozen=True)
class Tools:
    """The request's tools as the prompt shows them: function tools, a namespace's functions
    under flat names, custom tools as functions of their input, hosted tools left out."""

    functions: list[prompts.Tool]
    # (flat name, namespace, name) of every function given inside a namespace.
    namespaced: list[tuple[str, str, str]]
    # The tools a Response object repeats: those the model was given.
    served: list[dict[str, Any]]
    custom: list[custom_tools.CustomTool]

    @property
    def custom_names(self) -> list[str]:
        return [tool.name for tool in self.custom]

    def flat_name(self, name: str, namespace: str | None) -> str:
        return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


def _function(tool: dict[str, Any], name: str, where: str) -> prompts.Tool:
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise invalid(f"{where}.name: a function tool needs a name")
    parameters = tool.get("parameters") or {"type": "object", "properties": {}}
    spec = {"name": name, "description": tool.get("description") or "", "parameters": parameters}
    return {"type": "function", "function": spec}


def tools(request: ResponsesRequest) -> Tools:
    functions: list[prompts.Tool] = []
    namespaced: list[tuple[str, str, str]] = []
    served: list[dict[str, Any]] = []
    custom: list[custom_tools.CustomTool] = []
    for i, tool in enumerate(request.tools or []):
        kind = tool.get("type")
        where = f"tools.{i}"
        if kind == "function":
            functions.append(_function(tool, tool.get("name", ""), where))
            served.append(tool)
        elif kind == "custom":
            function, given = custom_tools.custom_tool(
                tool.get("name"), tool.get("description"), tool.get("format"), where
            )
            functions.append(function)
            custom.append(given)
            served.append(tool)
        elif kind == "namespace":
            namespace = tool.get("name")
            if not isinstance(namespace, str) or not namespace:
                raise invalid(f"{where}.name: a namespace tool needs a name")
            for j, inner in enumerate(tool.get("tools") or []):
                if inner.get("type", "function") != "function":
                    log.info("responses: skipping tool %s of namespace %s", inner, namespace)
                    continue
                flat = f"{namespace}{NAMESPACE_SEPARATOR}{inner.get('name')}"
                functions.append(_function(inner, flat, f"{where}.tools.{j}"))
                namespaced.append((flat, namespace, inner["name"]))
            served.append(tool)
        else:
            # Hosted tools (web_search, image_generation, local_shell, ...) have no server here.
            log.info("responses: skipping the hosted tool %r (%s)", kind, tool.get("name", ""))
    return Tools(functions, namespaced, served, custom)


def _named_tool(choice: dict[str, Any], tools: Tools) -> prompts.ToolChoice:
    if choice.get("type") == "function" and choice.get("name"):
        return prompts.ToolChoice("tool", tools.flat_name(choice["name"], choice.get("namespace")))
    if choice.get("type") == "custom" and choice.get("name"):
        return prompts.ToolChoice("tool", choice["name"])
    return prompts.ToolChoice()  # a hosted tool or allowed_tools: the model chooses


def text(
    content: str | list[dict[str, Any]] | None,
    where: str,
    images: list[prompts.ImageInput] | None = None,
    *,
    field: str = "content",
) -> str:
    """A message's text, its parts joined; its images (where `images` is given: a user's message
    or a tool's output) added to `images`, a mark standing for each where it is. A part that is
    neither is a 400 naming it."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type")
        at = f"{where}.{field}.{i}"
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            parts.append(part.get("text") or "")
        elif kind == "refusal":
            parts.append(part.get("refusal") or "")
        elif kind == "input_image" and images is not None:
            if part.get("image_url") is None and part.get("file_id") is not None:
                raise invalid(f"{at}.file_id: images by file_id need a file store; here is none")
            if part.get("image_url") is None:
                raise invalid(f"{at}: an input_image needs its image_url")
            parts.append(mark(images, from_url(part.get("image_url"), f"{at}.image_url")))
        elif kind == "input_image":
            raise invalid(f"{at}: images go in user messages and tool outputs")
        else:
            raise invalid(f"{at}: content part type {kind!r} is not supported")
    return "\n".join(parts)


def _reasoning(item: Item) -> str:
    """The reasoning text a replayed item carries: ours exactly as written when it comes back
    encrypted, else its reasoning text, else its summary."""
    if item.encrypted_content and (ours := reasoning_from_encrypted(item.encrypted_content)):
        return ours
    if isinstance(item.content, list) and item.content:
        return text(item.content, "reasoning")
    return "\n\n".join(part.get("text") or "" for part in item.summary or [])


def messages(
    request: ResponsesRequest,
    history: list[Item],
    tools: Tools,
    images: list[prompts.ImageInput] | None = None,
) -> list[prompts.Message]:
    """`instructions`, then the stored history (`previous_response_id`), then `input`; the
    images of user messages and tool outputs go to `images` (None: an image is a 400).

    System and developer messages before the model's first turn become one system message (after
    a compaction Codex sends its context messages after the user's first message: joined with
    the instructions, the prompt opens as it did before, from the prefix cache); a later one
    stays a system turn where it is (prompts.Renderer renders it so where the template takes one
    there). Reasoning, assistant text and function calls in a row are one assistant turn."""
    out: list[prompts.Message] = []
    system: list[str] = [request.instructions] if request.instructions else []
    assistant: prompts.Message | None = None

    def close_assistant() -> None:
        nonlocal assistant
        if assistant is not None:
            out.append(assistant)
            assistant = None

    def open_assistant() -> prompts.Message:
        nonlocal assistant
        if assistant is None:
            assistant = {"role": "assistant", "content": ""}
        return assistant

    for i, item in enumerate([*history, *request.items]):
        where = f"input.{i - len(history)}" if i >= len(history) else "previous_response_id"
        if item.type == "message":
            said = text(item.content, where, images if item.role == "user" else None)
            if item.role in ("system", "developer"):
                if assistant is None and not any(turn["role"] != "user" for turn in out):
                    system.append(said)
                else:
                    close_assistant()
                    out.append({"role": "system", "content": said})
            elif item.role == "assistant":
                turn = open_assistant()
                turn["content"] = f"{turn['content']}{said}"
            elif item.role == "user":
                close_assistant()
                out.append({"role": "user", "content": said})
            else:
                raise invalid(f"{where}.role: {item.role!r} is not a message role")
        elif item.type == "reasoning":
            if assistant is not None and (assistant["content"] or assistant.get("tool_calls")):
                close_assistant()
            turn = open_assistant()
            thought = _reasoning(item)
            turn[REASONING] = f"{turn[REASONING]}\n\n{thought}" if turn.get(REASONING) else thought
        elif item.type == "function_call":
            if not item.name or item.call_id is None:
                raise invalid(f"{where}: a function_call needs a name and a call_id")
            try:
                arguments = json.loads(item.arguments or "{}")
            except json.JSONDecodeError:
                raise invalid(f"{where}.arguments: not valid JSON") from None
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {
                    "name": tools.flat_name(item.name, item.namespace),
                    "arguments": arguments,
                },
            }
            open_assistant().setdefault("tool_calls", []).append(call)
        elif item.type == "custom_tool_call":
            if not item.name or item.call_id is None:
                raise invalid(f"{where}: a custom_tool_call needs a name and a call_id")
            custom = custom_tools.call(item.call_id, item.name, item.input or "")
            open_assistant().setdefault("tool_calls", []).append(custom)
        elif item.type in ("compaction", "compaction_summary"):
            summary = compaction_from_encrypted(item.encrypted_content or "")
            if summary is None:  # another server's: its summary cannot be read here
                log.info("responses: skipping a compaction item this server did not write")
                continue
            close_assistant()
            out.append(compaction.replaced(summary))
        elif item.type == "compaction_trigger":
            if i != len(history) + len(request.items) - 1:
                raise invalid(f"{where}: compaction_trigger must be the last input item")
            close_assistant()
            out.append(compaction.instruction())
        elif item.type in ("function_call_output", "custom_tool_call_output"):
            close_assistant()
            output = (
                item.output
                if isinstance(item.output, str)
                else text(item.output, where, images, field="output")
            )
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        else:
            log.info("responses: skipping an input item of type %r", item.type)
    close_assistant()
    if system:
        out.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return prompts.merge_turns(out)


def conversation(
    request: ResponsesRequest, history: list[Item], tools: Tools
) -> prompts.Conversation:
    effort = request.reasoning.effort if request.reasoning else None
    thinking = False if effort in ("none", "minimal") or request.compacting else None
    images: list[prompts.ImageInput] = []
    return prompts.Conversation(
        messages(request, history, tools, images),
        tools.functions,
        tool_choice(
            request.tool_choice,
            lambda named: _named_tool(named, tools),
            # No function to call (hosted tools are left out): "required" leaves it to the model.
            any_callable=bool(tools.functions),
        ),
        thinking=thinking,
        structured=request.text_format != "text",
        input_grammars=custom_tools.grammars(tools.custom),
        custom_tools=tools.custom_names,
        images=images,
    )
