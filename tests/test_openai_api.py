"""OpenAI Chat Completions and Completions against the real server and model, via the openai SDK."""

from __future__ import annotations

import json
from typing import Any

import httpx
import httpx2
import openai
import pytest

from conftest import (
    InProcessServer,
    RunningServer,
    broken_after_first_frames,
    broken_render,
    last_frames,
)
from mlxgate import chat
from mlxgate.api import http

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
BASH = {
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
    completion = client.chat.completions.create(model="local", messages=QUESTION, max_tokens=32)  # type: ignore[arg-type]
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
            messages=QUESTION,  # type: ignore[arg-type]
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
    assert all(f.startswith("data: ") for f in frames) and "event:" not in raw
    assert frames[-1] == "data: [DONE]"


def test_length_and_stop_sequences(client: openai.OpenAI) -> None:
    short = client.chat.completions.create(
        model="local", messages=QUESTION, max_completion_tokens=3
    )  # type: ignore[arg-type]
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3  # type: ignore[union-attr]
    full = (
        client.chat.completions.create(model="local", messages=QUESTION, max_tokens=32)
        .choices[0]
        .message.content
    )  # type: ignore[arg-type]
    stopped = client.chat.completions.create(
        model="local", messages=QUESTION, max_tokens=32, stop=["Paris"]
    )  # type: ignore[arg-type]
    assert stopped.choices[0].finish_reason == "stop"
    assert (full or "").startswith((stopped.choices[0].message.content or "").rstrip())
    assert "Paris" not in (stopped.choices[0].message.content or "")


def test_forced_tool_call_round_trip(client: openai.OpenAI) -> None:
    question = {"role": "user", "content": "List the files in the current directory."}
    stream = client.chat.completions.create(
        model="local",
        messages=[question],  # type: ignore[list-item]
        tools=[BASH],  # type: ignore[list-item]
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
        ],  # type: ignore[list-item]
        tools=[BASH],  # type: ignore[list-item]
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
    with pytest.raises(openai.BadRequestError) as n2:
        client.chat.completions.create(model="local", messages=QUESTION, n=2)  # type: ignore[arg-type]
    assert n2.value.param == "n"
    bad = httpx.post(f"{server.url}/v1/chat/completions", content=b"{oops", timeout=10)
    assert bad.status_code == 400 and set(bad.json()["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }
    assert "type" not in bad.json() or bad.json().get("type") != "error"


def openai_error(response: httpx.Response | httpx2.Response, error_type: str) -> dict[str, Any]:
    """The error of an OpenAI envelope, never Anthropic's `{"type": "error", ...}`."""
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == error_type
    error: dict[str, Any] = body["error"]
    return error


def test_model_aliases_and_strict_models(aliased_server: RunningServer) -> None:
    client = openai.OpenAI(base_url=f"{aliased_server.url}/v1", api_key="sk-local", max_retries=0)
    names = ["SmolLM2-135M-Instruct", "claude-local", "gpt-local"]
    assert [model.id for model in client.models.list()] == names
    assert client.models.retrieve("gpt-local").id == "gpt-local"
    reply = client.chat.completions.create(model="gpt-local", messages=QUESTION, max_tokens=4)  # type: ignore[arg-type]
    assert reply.model == "SmolLM2-135M-Instruct"
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-5", messages=QUESTION, max_tokens=4)  # type: ignore[arg-type]
    assert openai_error(caught.value.response, "invalid_request_error")["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-5", prompt="One, two,", max_tokens=2)


def test_auth_error_is_401(strict_server: RunningServer) -> None:
    wrong = openai.OpenAI(base_url=f"{strict_server.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.chat.completions.create(model="m", messages=QUESTION, max_tokens=2)  # type: ignore[arg-type]
    assert openai_error(caught.value.response, "invalid_request_error")["code"] == "invalid_api_key"
    assert caught.value.response.headers["x-should-retry"] == "false"
    with pytest.raises(openai.AuthenticationError) as listing:
        wrong.models.list()
    openai_error(listing.value.response, "invalid_request_error")
    right = openai.OpenAI(base_url=f"{strict_server.url}/v1", api_key="sk-right", max_retries=0)
    assert right.chat.completions.create(model="m", messages=QUESTION, max_tokens=2).choices  # type: ignore[arg-type]


def test_request_too_large_is_413(client: openai.OpenAI) -> None:
    huge = [{"role": "user", "content": "x" * (33 * 1024 * 1024)}]
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="m", messages=huge, max_tokens=1)  # type: ignore[arg-type]
    assert caught.value.status_code == 413  # the SDK has no class of its own for 413
    assert "32 MB" in openai_error(caught.value.response, "invalid_request_error")["message"]


def test_queue_full_is_503_with_retry_after(strict_server: RunningServer) -> None:
    long_prompt = [{"role": "user", "content": "word " * 3000}]
    body = {"model": "m", "max_tokens": 4, "messages": long_prompt, "stream": True}
    url = f"{strict_server.url}/v1/chat/completions"
    sdk = openai.OpenAI(base_url=f"{strict_server.url}/v1", api_key="sk-right", max_retries=0)
    with httpx.Client(timeout=120) as raw:
        request = raw.build_request(
            "POST", url, json=body, headers={"authorization": "Bearer sk-right"}
        )
        first = raw.send(request, stream=True)  # admitted: it fills the one-request queue
        assert first.status_code == 200
        with pytest.raises(openai.InternalServerError) as caught:
            sdk.chat.completions.create(model="m", messages=long_prompt, max_tokens=4)  # type: ignore[arg-type]
        first.close()
    assert caught.value.status_code == 503
    openai_error(caught.value.response, "server_error")
    assert int(caught.value.response.headers["retry-after"]) >= 1


def test_rate_limit_per_client_is_429(limited_server: RunningServer) -> None:
    # Long prompts keep both requests in flight (prefilling) while the third arrives.
    body = {
        "model": "m",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "word " * 1500}],
    }
    url = f"{limited_server.url}/v1/chat/completions"
    headers = {"authorization": "Bearer client-a"}
    with httpx.Client(timeout=120) as raw:
        busy = [
            raw.send(
                raw.build_request("POST", url, json={**body, "stream": True}, headers=headers),
                stream=True,
            )
            for _ in range(2)
        ]
        assert [response.status_code for response in busy] == [200, 200]
        same = openai.OpenAI(base_url=f"{limited_server.url}/v1", api_key="client-a", max_retries=0)
        with pytest.raises(openai.RateLimitError) as caught:
            same.chat.completions.create(model="m", messages=QUESTION, max_tokens=2)  # type: ignore[arg-type]
        error = openai_error(caught.value.response, "rate_limit_error")
        assert error["code"] == "rate_limit_exceeded"
        assert caught.value.response.headers["retry-after"] == "1"
        other = openai.OpenAI(
            base_url=f"{limited_server.url}/v1", api_key="client-b", max_retries=0
        )
        # Another client is admitted at once (its stream starts; no need to wait for its turn).
        with other.chat.completions.create(
            model="m",
            messages=QUESTION,  # type: ignore[arg-type]
            max_tokens=2,
            stream=True,
        ) as admitted:
            assert next(iter(admitted)).choices[0].delta.role == "assistant"
        for response in busy:
            response.close()


def in_process_client(in_process: InProcessServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{in_process.base_url}/v1",
        api_key="sk-local",
        max_retries=0,
        http_client=in_process.http_client(),
    )


@pytest.mark.anyio
async def test_engine_failure_is_500_in_the_openai_envelope(in_process: InProcessServer) -> None:
    async with in_process_client(in_process) as client:
        in_process.router.fail_after(0)
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model="m", messages=QUESTION, max_tokens=16)  # type: ignore[arg-type]
        assert caught.value.status_code == 500
        error = openai_error(caught.value.response, "server_error")
        assert error["message"] == "generation failed: injected fault"

        # Streamed, the failure comes after the headers and some text: an error chunk, [DONE].
        in_process.router.fail_after(3)
        texts = []
        with pytest.raises(openai.APIError) as streamed:
            async for chunk in await client.chat.completions.create(
                model="m",
                messages=QUESTION,  # type: ignore[arg-type]
                max_tokens=16,
                stream=True,
            ):
                texts.append(chunk.choices[0].delta.content or "")
        assert "".join(texts)
        assert streamed.value.body["type"] == "server_error"  # type: ignore[index]

        in_process.router.fail_after(1)
        raw = await client.post(
            "/chat/completions",
            body={"model": "m", "max_tokens": 16, "messages": QUESTION, "stream": True},
            cast_to=httpx2.Response,
        )
        assert raw.status_code == 200
        error_frame, done = last_frames(raw.text, 2)
        assert json.loads(error_frame.removeprefix("data: "))["error"]["type"] == "server_error"
        assert done == "data: [DONE]"

        reply = await client.chat.completions.create(model="m", messages=QUESTION, max_tokens=8)  # type: ignore[arg-type]
        assert reply.choices[0].message.content


@pytest.mark.anyio
async def test_unexpected_errors_before_and_after_headers(
    in_process: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with in_process_client(in_process) as client:
        with monkeypatch.context() as patch:
            patch.setattr(chat.Renderer, "render", broken_render)
            with pytest.raises(openai.InternalServerError) as caught:
                await client.chat.completions.create(model="m", messages=QUESTION, max_tokens=8)  # type: ignore[arg-type]
        assert caught.value.status_code == 500
        openai_error(caught.value.response, "server_error")

        with monkeypatch.context() as patch:
            patch.setattr(http, "chunks", broken_after_first_frames)
            raw = await client.post(
                "/chat/completions",
                body={"model": "m", "max_tokens": 8, "messages": QUESTION, "stream": True},
                cast_to=httpx2.Response,
            )
        assert raw.status_code == 200 and raw.text.startswith("data: {")
        error_frame, done = last_frames(raw.text, 2)
        assert json.loads(error_frame.removeprefix("data: "))["error"]["type"] == "server_error"
        assert done == "data: [DONE]"

        reply = await client.chat.completions.create(model="m", messages=QUESTION, max_tokens=8)  # type: ignore[arg-type]
        assert reply.choices[0].message.content
