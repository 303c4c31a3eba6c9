"""The official SDKs' answers as the tests read them. An answer's item, block or event is one of
a union the SDK declares (a Responses output item, a Messages content block, a stream event):
`expect` asserts which one it is, and the test reads its fields with their types. `replayed`
sends an output item back as the next request's input, as the SDKs' docs replay a conversation;
`functions` are the functions a Chat Completions message calls."""

from __future__ import annotations

from typing import TypeVar, cast

import pydantic
from openai.types.chat import ChatCompletionMessage, ChatCompletionMessageFunctionToolCall
from openai.types.chat.chat_completion_message_function_tool_call import Function
from openai.types.responses import ResponseInputItemParam

T = TypeVar("T")


def expect(kind: type[T], value: object) -> T:
    """`value`, asserted to be a `kind`."""
    assert isinstance(value, kind), f"expected a {kind.__name__}, got {value!r}"
    return value


def replayed(item: pydantic.BaseModel) -> ResponseInputItemParam:
    """A Responses output item as an input item of the next request: its fields, those the server
    left out (None) left out. Each output item's fields are those of its input counterpart
    (`ResponseOutputMessage` and `ResponseOutputMessageParam`, ...)."""
    return cast(ResponseInputItemParam, item.model_dump(exclude_none=True))


def functions(message: ChatCompletionMessage) -> list[Function]:
    """The functions a Chat Completions message calls: each of its tool calls, asserted to be a
    function call (not a custom tool's)."""
    return [
        expect(ChatCompletionMessageFunctionToolCall, call).function
        for call in message.tool_calls or []
    ]
