"""The OpenAI Responses API through the official openai SDK and raw HTTP, against a real server
with the embedded model: text, streamed events, function calls, stored responses, errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import NamespaceToolParam, ResponseOutputMessage, ToolParam

from mlxgate._native import reasoning_from_encrypted
from mlxgate.api.responses.requests import Item, ResponsesRequest, messages, tools
from mlxgate.formats.reasoning import FIELD as REASONING
from support.sdk import expect, replayed
from support.servers import RunningServer
from support.sse import without_id

QUESTION = "What is the capital of France?"
# Without `strict`, which the SDK's FunctionToolParam requires and mlxgate does not: no
# FunctionToolParam, Any as the SDK's calls take it.
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
FILES: NamespaceToolParam = {
    "type": "namespace",
    "name": "mcp__files",
    "description": "Files on disk",
    "tools": [
        {
            "type": "function",
            "name": "read",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        }
    ],
}
# Hosted tools: nothing here runs them, so they are left out of the prompt (never a 400).
HOSTED: list[ToolParam] = [
    {"type": "web_search"},
    {"type": "image_generation"},
    {"type": "local_shell"},
]


@pytest.fixture
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-local", max_retries=0)


def sse_events(body: str) -> list[dict[str, Any]]:
    """Each frame's data, checked to name its event."""
    events = []
    for frame in body.split("\n\n"):
        if not frame:
            continue
        event_line, data_line = without_id(frame).split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"
        events.append(data)
    return events


def test_create_answers_with_a_message_and_usage(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="m", input=QUESTION, instructions="Answer in one word.", max_output_tokens=24
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "completed"
    assert "Paris" in response.output_text
    assert [item.type for item in response.output] == ["message"]
    assert response.instructions == "Answer in one word."
    usage = response.usage
    assert usage is not None and usage.input_tokens > 10 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_responses_and_chat_completions_render_alike(client: openai.OpenAI) -> None:
    """One conversation, two dialects: the same prompt, so the same greedy reply."""
    response = client.responses.create(
        model="m", input=[{"role": "user", "content": QUESTION}], max_output_tokens=16
    )
    completion = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": QUESTION}], max_tokens=16
    )
    assert response.output_text == completion.choices[0].message.content
    assert response.usage is not None and completion.usage is not None
    assert response.usage.input_tokens == completion.usage.prompt_tokens


def test_stream_events_come_in_order_with_sequence_numbers(server: RunningServer) -> None:
    body = {"model": "m", "input": QUESTION, "max_output_tokens": 24, "stream": True}
    raw = httpx.post(f"{server.url}/v1/responses", json=body, timeout=120)
    assert raw.status_code == 200
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw.text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    created, completed = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert completed["id"] == created["id"] and completed["status"] == "completed"
    text = "".join(d["delta"] for d in deltas)
    assert text and events[-4]["text"] == text
    assert completed["output"][0]["content"][0]["text"] == text
    # One token per delta (an ASCII answer), and the end-of-turn token.
    assert completed["usage"]["output_tokens"] == len(deltas) + 1


def test_sdk_stream_and_create_agree(client: openai.OpenAI) -> None:
    with client.responses.stream(model="m", input=QUESTION, max_output_tokens=24) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(deltas)
    again = client.responses.create(model="m", input=QUESTION, max_output_tokens=24)
    assert again.output_text == final.output_text
    assert again.usage is not None and again.usage.input_tokens_details.cached_tokens > 0


def test_max_output_tokens_one_is_an_incomplete_response(client: openai.OpenAI) -> None:
    response = client.responses.create(model="m", input=QUESTION, max_output_tokens=1)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 1
    assert expect(ResponseOutputMessage, response.output[0]).status == "incomplete"


def test_previous_response_id_continues_the_stored_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(model="m", input=QUESTION, max_output_tokens=16)
    second = client.responses.create(
        model="m",
        input="And of Italy?",
        previous_response_id=first.id,
        max_output_tokens=16,
    )
    assert second.previous_response_id == first.id
    assert "Rome" in second.output_text
    assert first.usage is not None and second.usage is not None
    # The history is in the prompt, and the first prompt's KV is reused for it.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 0.9 * first.usage.input_tokens

    assert client.responses.retrieve(first.id).output_text == first.output_text
    # Typed as returning an object, so that what it returns can be checked: None.
    delete: Callable[[str], object] = client.responses.delete
    assert delete(first.id) is None  # the SDK returns nothing for a 200
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="m", input="Hi", previous_response_id=first.id)
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    response = client.responses.create(model="m", input=QUESTION, max_output_tokens=2, store=False)
    # `store` is no field of the SDK's Response: one of its extra fields.
    assert response.model_extra is not None and response.model_extra["store"] is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_forced_function_call_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="m",
        input="What is the weather in Paris?",
        tools=[WEATHER, FILES, *HOSTED],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
    )
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert isinstance(json.loads(call.arguments), dict)
    assert call.call_id.startswith("call_") and call.id and call.id.startswith("fc_")
    assert {tool.type for tool in first.tools} == {"function", "namespace"}

    answered = client.responses.create(
        model="m",
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            replayed(call),
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
        ],
        tools=[WEATHER],
        max_output_tokens=24,
    )
    assert answered.output and answered.output[0].type == "message"
    assert answered.output_text


def test_a_namespaced_function_is_called_under_its_namespace(server: RunningServer) -> None:
    body = {
        "model": "m",
        "input": "Read the file notes.txt",
        "tools": [WEATHER, FILES],
        "tool_choice": {"type": "function", "name": "read", "namespace": "mcp__files"},
        "max_output_tokens": 40,
        "stream": True,
    }
    raw = httpx.post(f"{server.url}/v1/responses", json=body, timeout=120)
    events = sse_events(raw.text)
    call = next(e["item"] for e in events if e["type"] == "response.output_item.done")
    assert (call["type"], call["name"], call["namespace"]) == (
        "function_call",
        "read",
        "mcp__files",
    )
    deltas = "".join(
        e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
    )
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == deltas == call["arguments"]
    assert isinstance(json.loads(deltas), dict)


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b'{"model": "m"}', 400, "input"),
        (b'{"model": "m", "input": "hi", "temperature": 3}', 400, "temperature"),
        (
            b'{"model": "m", "input": [{"role": "user", "content": [{"type": "input_image"}]}]}',
            400,
            "input_image",
        ),
        (b'{"model": "m", "input": "hi", "previous_response_id": "resp_nope"}', 404, "resp_nope"),
        (
            b'{"model": "m", "input": [{"type": "function_call", "name": "f"}]}',
            400,
            "call_id",
        ),
    ],
    ids=["json", "no-input", "temperature", "image", "unknown-previous", "call-without-id"],
)
def test_bad_requests_get_openais_envelope(
    server: RunningServer, body: bytes, status: int, message: str
) -> None:
    response = httpx.post(f"{server.url}/v1/responses", content=body, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"]


def test_a_prompt_over_the_context_is_context_length_exceeded(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="m", input="word " * 40_000, max_output_tokens=4)
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "context_length_exceeded"
    assert error["message"].startswith("prompt is too long: ")
    assert client.responses.create(model="m", input="Hi", max_output_tokens=2).status


def _request(**body: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", **body})


def test_system_and_developer_messages_lead_as_one_system_turn() -> None:
    """The ones before the model's first turn join `instructions` (Codex, after a compaction,
    sends some after the user's first message); a later one stays where it is (chat.Renderer
    places it), so the rendered prefix of earlier turns never changes."""
    request = _request(
        instructions="Be brief.",
        input=[
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "A"}],
            },
            {"role": "system", "content": "B"},
            {"role": "user", "content": "Hi"},
            {"role": "developer", "content": "C"},
            {"role": "assistant", "content": "Hello."},
            {"role": "developer", "content": "D"},
        ],
    )
    turns = messages(request, [], tools(request))
    assert turns == [
        {"role": "system", "content": "Be brief.\n\nA\n\nB\n\nC"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "system", "content": "D"},
    ]


def test_reasoning_text_and_calls_in_a_row_are_one_assistant_turn() -> None:
    encrypted = "mlxgate-reasoning-v1.TGV0IG1lIHRoaW5rLg"  # "Let me think." (URL-safe base64)
    assert reasoning_from_encrypted(encrypted) == "Let me think."
    said = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Ok."}],
    }
    weather = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    read = {"type": "function_call", "call_id": "c2", "name": "read", "namespace": "mcp__files"}
    notes = [{"type": "input_text", "text": "notes"}]
    request = _request(
        tools=[WEATHER, FILES],
        input=[
            {"role": "user", "content": "Weather?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": encrypted},
            said,
            {**weather, "arguments": '{"city": "Paris"}'},
            read,
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": notes},
        ],
    )
    given = tools(request)
    assert [t["function"]["name"] for t in given.functions] == ["get_weather", "mcp__files__read"]
    assert given.namespaced == [("mcp__files__read", "mcp__files", "read")]
    _, assistant, first_result, second_result = messages(request, [], given)
    assert assistant[REASONING] == "Let me think." and assistant["content"] == "Ok."
    calls = [
        (c["id"], c["function"]["name"], c["function"]["arguments"])
        for c in assistant["tool_calls"]
    ]
    assert calls == [("c1", "get_weather", {"city": "Paris"}), ("c2", "mcp__files__read", {})]
    assert first_result == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert second_result["content"] == "notes"


def test_a_reasoning_item_without_our_encryption_replays_its_text_or_summary() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {"content": [{"type": "reasoning_text", "text": "raw"}], "encrypted_content": "gAAA"},
            "raw",
        ),
        ({"summary": [{"type": "summary_text", "text": "short"}]}, "short"),
    ]
    for item, text in cases:
        request = _request(input=[{"role": "user", "content": "q"}, {"type": "reasoning", **item}])
        assert messages(request, [], tools(request))[-1][REASONING] == text


def test_stored_history_items_replay_as_given() -> None:
    history = [
        Item.model_validate({"role": "user", "content": "q1"}),
        Item.model_validate(
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "a1", "annotations": []}]}
        ),
    ]  # fmt: skip
    request = _request(input="q2")
    assert messages(request, history, tools(request)) == [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
