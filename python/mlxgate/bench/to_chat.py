"""A recorded Anthropic Messages or OpenAI Responses request rewritten as a Chat Completions
request, so that an agent trace can be replayed against a server that speaks only that
(mlx_lm.server, llama-server). The conversation is the one mlxgate itself reads from the
request (`api.anthropic.requests.conversation`, `api.responses.requests.conversation`): the
same turns, tool calls and results, function tools and limits reach every server. What chat
completions has no place for (thinking and reasoning, server-side tools) is left out."""

from __future__ import annotations

from typing import Any


def to_chat(dialect: str, body: dict[str, Any]) -> dict[str, Any]:
    """`body`, a request of `dialect`, as a Chat Completions request body."""
    if dialect == "openai":
        return dict(body)
    # The server's request models load the chat renderer (MLX, transformers): only a replay to
    # a chat-only server needs them.
    from mlxgate import prompts
    from mlxgate.api.anthropic import requests as anthropic
    from mlxgate.api.responses import requests as responses
    from mlxgate.formats.reasoning import FIELD as REASONING

    limit: int | None
    stop: list[str] | None
    if dialect == "anthropic":
        messages_request = anthropic.MessagesRequest.model_validate(body)
        conversation = anthropic.conversation(messages_request)
        limit, stop = messages_request.max_tokens, messages_request.stop_sequences
    elif dialect == "responses":
        responses_request = responses.ResponsesRequest.model_validate(body)
        tools = responses.tools(responses_request)
        conversation = responses.conversation(responses_request, [], tools)
        limit, stop = responses_request.max_output_tokens, None
    else:
        raise ValueError(f"no chat form for the {dialect!r} dialect")
    messages = [{k: v for k, v in m.items() if k != REASONING} for m in conversation.messages]
    chat_body = {
        "messages": prompts.with_arguments_as_json(messages),
        "max_tokens": limit,
        "stop": stop or None,
        "tools": conversation.tools or None,
    }
    chat_body |= {
        key: body[key] for key in ("model", "stream", "temperature", "top_p") if key in body
    }
    return {key: value for key, value in chat_body.items() if value is not None}
