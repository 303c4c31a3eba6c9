"""OpenAI Chat Completions and Completions against the real server and model, via the openai SDK."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import (
    ChatCompletionFunctionToolParam,
    ChatCompletionMessageParam,
    ChatCompletionUserMessageParam,
)

from support.servers import RunningServer, metric

QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France?"}
]
BASH: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "Bash",
        "description": "Executes a bash command and returns its output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The command to run"}},
            "required": ["command"],
        },
    },
}


@pytest.fixture
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-local", max_retries=0)


def test_chat_completion(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model="local", messages=QUESTION, max_tokens=32)
    choice = completion.choices[0]
    assert "Paris" in (choice.message.content or "")
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    assert completion.model == "SmolLM2-135M-Instruct" and completion.id.startswith("chatcmpl-")
    usage = completion.usage
    assert usage is not None and usage.prompt_tokens > 10 and usage.completion_tokens > 1
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_streaming_with_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="local",
            messages=QUESTION,
            max_tokens=32,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens > 1
    # The prefix cache served the repeated prompt, and says so.
    details = chunks[-1].usage.prompt_tokens_details
    assert details is not None and (details.cached_tokens or 0) > 0


def test_raw_stream_ends_with_done(server: RunningServer) -> None:
    body = {"model": "m", "messages": QUESTION, "max_tokens": 8, "stream": True}
    raw = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).text
    frames = [f for f in raw.split("\n\n") if f]
    assert "event:" not in raw
    for number, frame in enumerate(frames, 1):
        assert frame.startswith(f"id: {number}\ndata: "), frame
    assert frames[-1].endswith("\ndata: [DONE]")


def test_length_and_stop_sequences(client: openai.OpenAI) -> None:
    short = client.chat.completions.create(
        model="local", messages=QUESTION, max_completion_tokens=3
    )
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3  # type: ignore[union-attr]
    full = (
        client.chat.completions.create(model="local", messages=QUESTION, max_tokens=32)
        .choices[0]
        .message.content
    )
    stopped = client.chat.completions.create(
        model="local", messages=QUESTION, max_tokens=32, stop=["Paris"]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert (full or "").startswith((stopped.choices[0].message.content or "").rstrip())
    assert "Paris" not in (stopped.choices[0].message.content or "")


def test_forced_tool_call_round_trip(client: openai.OpenAI) -> None:
    question: ChatCompletionUserMessageParam = {
        "role": "user",
        "content": "List the files in the current directory.",
    }
    stream = client.chat.completions.create(
        model="local",
        messages=[question],
        tools=[BASH],
        tool_choice={"type": "function", "function": {"name": "Bash"}},
        max_tokens=256,
        stream=True,
    )
    deltas = [c.choices[0].delta for c in stream if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert calls[0].id and calls[0].id.startswith("call_") and calls[0].function.name == "Bash"  # type: ignore[union-attr]
    fragments = [tc.function.arguments for tc in calls if tc.function and tc.function.arguments]
    assert len(fragments) > 1, "arguments stream incrementally"
    arguments = json.loads("".join(fragments))
    assert isinstance(arguments, dict)
    follow_up = client.chat.completions.create(
        model="local",
        messages=[
            question,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": calls[0].id,
                        "type": "function",
                        "function": {"name": "Bash", "arguments": json.dumps(arguments)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": calls[0].id, "content": "README.md\nsrc\n"},
        ],
        tools=[BASH],
        max_tokens=32,
    )
    assert follow_up.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_completions_endpoint(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model="local", prompt="The capital of France is", max_tokens=5
    )
    assert completion.object == "text_completion"
    assert completion.choices[0].text and completion.usage.completion_tokens == 5  # type: ignore[union-attr]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="local", prompt="One, two,", max_tokens=4, stream=True
        )
        if c.choices
    )
    assert streamed
    with pytest.raises(openai.BadRequestError) as one_token:
        client.completions.create(model="local", prompt="Hi", max_tokens=2)
    assert one_token.value.param == "prompt" and "at least 2 tokens" in one_token.value.message
    again = client.completions.create(model="local", prompt="Hi there", max_tokens=2)
    assert again.choices[0].text


def test_logprobs_streamed_and_not(client: openai.OpenAI) -> None:
    """Each token's logprob and its top alternatives: greedy picks the likeliest, the
    alternatives are a distribution's top (sorted, summing to at most 1), the tokens spell the
    text, and a stream reports what the body does."""
    ask: Any = {"model": "local", "messages": QUESTION, "max_tokens": 12, "temperature": 0}
    completion = client.chat.completions.create(**ask, logprobs=True, top_logprobs=3)
    choice = completion.choices[0]
    content = choice.logprobs.content
    assert content and len(content) == completion.usage.completion_tokens - (
        choice.finish_reason == "stop"
    )  # an end-of-turn token has no text and no logprob
    assert "".join(t.token for t in content) == choice.message.content
    for token in content:
        assert bytes(token.bytes or []).decode(errors="replace") == token.token
        top = token.top_logprobs
        assert len(top) == 3 and top[0].token == token.token
        assert abs(top[0].logprob - token.logprob) < 1e-5
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert sum(math.exp(t.logprob) for t in top) <= 1 + 1e-5
    streamed = [
        entry
        for chunk in client.chat.completions.create(
            **ask, logprobs=True, top_logprobs=3, stream=True
        )
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content or []
    ]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, content, strict=True))
    plain = client.chat.completions.create(**ask)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == choice.message.content

    legacy = client.completions.create(
        model="local", prompt="The capital of France is", max_tokens=5, logprobs=2, temperature=0
    )
    logprobs = legacy.choices[0].logprobs
    assert logprobs is not None and len(logprobs.tokens or []) == 5
    assert "".join(logprobs.tokens or []) == legacy.choices[0].text
    assert all(len(top) <= 2 for top in logprobs.top_logprobs or [])
    assert logprobs.text_offset == sorted(set(logprobs.text_offset or []))
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**ask, top_logprobs=2)
    assert caught.value.param == "top_logprobs"


def prefilled_tokens(server: RunningServer) -> float:
    return metric(server, "mlxgate_engine_prefill_tokens_total")


def test_n_choices_share_one_prefill(client: openai.OpenAI, server: RunningServer) -> None:
    """n=3: greedy gives three identical choices, sampling with a seed three different ones
    (each choice its own seed), streamed interleaved with their own indices and then one usage
    chunk; the prompt is prefilled once for all three."""
    ask: Any = {
        "model": "local",
        "messages": [{"role": "user", "content": "Name a colour (n-choices test)."}],
        "max_tokens": 12,
        "n": 3,
    }
    before = prefilled_tokens(server)
    greedy = client.chat.completions.create(**ask, temperature=0)
    prompt_tokens = greedy.usage.prompt_tokens
    cached = greedy.usage.prompt_tokens_details.cached_tokens
    # Once, not three times (the last prompt token is each choice's first decode input).
    assert prefilled_tokens(server) - before == prompt_tokens - 1 - cached
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.message.content for c in greedy.choices}) == 1
    alone = client.chat.completions.create(**{**ask, "n": 1}, temperature=0)
    assert greedy.choices[0].message.content == alone.choices[0].message.content
    each = alone.usage.completion_tokens
    assert greedy.usage.completion_tokens == 3 * each

    sampled = client.chat.completions.create(**ask, temperature=1.0, seed=7)
    texts = [c.message.content for c in sampled.choices]
    assert len(set(texts)) == 3, texts
    streamed: dict[int, str] = {0: "", 1: "", 2: ""}
    usage = []
    order = []
    for chunk in client.chat.completions.create(
        **ask, temperature=1.0, seed=7, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.usage is not None:
            usage.append(chunk.usage)
        for choice in chunk.choices:
            order.append(choice.index)
            streamed[choice.index] += choice.delta.content or ""
    assert [streamed[i] for i in range(3)] == texts
    assert len(usage) == 1 and usage[0].prompt_tokens == prompt_tokens
    assert usage[0].completion_tokens == sampled.usage.completion_tokens
    assert order != sorted(order), "the choices' chunks are interleaved as they come"

    legacy = client.completions.create(
        model="local", prompt="Colours: red, green,", max_tokens=4, n=2, temperature=0
    )
    assert [c.index for c in legacy.choices] == [0, 1]
    assert legacy.choices[0].text == legacy.choices[1].text


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]
    assert client.models.retrieve("SmolLM2-135M-Instruct").id == "SmolLM2-135M-Instruct"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("nope")
    assert caught.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_errors_use_the_openai_envelope(client: openai.OpenAI, server: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(
            model="local", messages=[{"role": "user", "content": "word " * 9000}], max_tokens=4
        )
    assert too_long.value.code == "context_length_exceeded"
    assert "prompt is too long" in too_long.value.message
    with pytest.raises(openai.BadRequestError) as too_many:
        client.chat.completions.create(model="local", messages=QUESTION, n=17)
    assert too_many.value.body["message"].startswith("n: ")  # type: ignore[index]
    bad = httpx.post(f"{server.url}/v1/chat/completions", content=b"{oops", timeout=10)
    assert bad.status_code == 400 and set(bad.json()["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }
    assert "type" not in bad.json() or bad.json().get("type") != "error"
