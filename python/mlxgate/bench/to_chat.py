"""A recorded Anthropic Messages or OpenAI Responses request rewritten as a Chat Completions
request, so that an agent trace can be replayed against a server that speaks only that
(mlx_lm.server, llama-server): the same conversation, tools and limits. What chat completions
has no place for (thinking and reasoning items, images, server-side tools such as web search)
is left out."""

from __future__ import annotations

import json
from typing import Any

Message = dict[str, Any]


def to_chat(dialect: str, body: dict[str, Any]) -> dict[str, Any]:
    """`body`, a request of `dialect`, as a Chat Completions request body."""
    if dialect == "openai":
        return dict(body)
    if dialect == "anthropic":
        messages = _anthropic_messages(body)
        tools = [_function(t["name"], t.get("description"), t.get("input_schema")) for t in
                 body.get("tools") or () if "input_schema" in t]  # fmt: skip
        limit, stop = body.get("max_tokens"), body.get("stop_sequences")
    elif dialect == "responses":
        messages = _responses_messages(body)
        tools = [_function(t["name"], t.get("description"), t.get("parameters")) for t in
                 body.get("tools") or () if t.get("type") == "function"]  # fmt: skip
        limit, stop = body.get("max_output_tokens"), None
    else:
        raise ValueError(f"no chat form for the {dialect!r} dialect")
    chat = {
        "messages": _adjacent_systems_joined(messages),
        "max_tokens": limit,
        "stop": stop or None,
        "tools": tools or None,
    }
    chat |= {key: body[key] for key in ("model", "stream", "temperature", "top_p") if key in body}
    return {key: value for key, value in chat.items() if value is not None}


def _adjacent_systems_joined(messages: list[Message]) -> list[Message]:
    """One system message where there were several in a row (Codex sends two developer
    messages; many chat templates take one system message, first)."""
    joined: list[Message] = []
    for message in messages:
        if joined and message["role"] == joined[-1]["role"] == "system":
            joined[-1] = {
                **joined[-1],
                "content": f"{joined[-1]['content']}\n\n{message['content']}",
            }
        else:
            joined.append(message)
    return joined


def _function(name: str, description: str | None, parameters: Any) -> dict[str, Any]:
    function = {"name": name, "parameters": parameters or {"type": "object", "properties": {}}}
    if description:
        function["description"] = description
    return {"type": "function", "function": function}


def _text(content: Any) -> str:
    """The text of a content string or list of blocks (text, input_text, output_text)."""
    if isinstance(content, str):
        return content
    return "".join(block.get("text", "") for block in content or () if isinstance(block, dict))


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _anthropic_messages(body: dict[str, Any]) -> list[Message]:
    messages: list[Message] = []
    if body.get("system"):
        messages.append({"role": "system", "content": _text(body["system"])})
    for message in body.get("messages") or ():
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if message.get("role") == "assistant":
            calls = [_call(b["id"], b["name"], json.dumps(b.get("input") or {}))
                     for b in blocks if b.get("type") == "tool_use"]  # fmt: skip
            text = _text([b for b in blocks if b.get("type") == "text"])
            messages.append({"role": "assistant", "content": text, **({"tool_calls": calls}
                             if calls else {})})  # fmt: skip
            continue
        # A tool's result answers the assistant's call, so it comes before the user's words.
        for block in blocks:
            if block.get("type") == "tool_result":
                content = block.get("content")
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": block["tool_use_id"],
                        "content": _text(content),
                    }
                )
        text = _text([b for b in blocks if b.get("type") == "text"])
        if text:
            messages.append({"role": "user", "content": text})
    return messages


def _responses_messages(body: dict[str, Any]) -> list[Message]:
    messages: list[Message] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    for item in items or ():
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role", "user")
            messages.append({"role": role, "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = _call(item["call_id"], item["name"], item.get("arguments") or "{}")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant message
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": _text(output)}
            )
    return messages
