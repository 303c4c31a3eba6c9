"""The scenarios every API dialect shares, once per dialect: auth, limits, overload, model names,
failures before and after the headers. Each answers in its own envelope with the status its
official SDK maps to the right exception."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from mlxgate import prompts
from mlxgate.api import reader
from mlxgate.engine import GenerationRequest
from support.in_process import InProcessServer, broken_after_first_frames, broken_render
from support.servers import RunningServer, metric
from support.sse import last_frames

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SERVED = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Dialect:
    name: str
    path: str  # the generation route
    base: str  # what the SDK's base_url adds to the server's URL
    sdk: Callable[..., Any]  # the official SDK's client class
    # By scenario: the error type in the envelope, and what the SDK raises for it.
    types: dict[str, str]
    raises: dict[str, type[Exception]]
    overloaded_status: int
    # How a stream starts, and what only a stream with generated text holds.
    first_line: str
    text_marker: str

    def body(self, messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> dict[str, Any]:
        if self.name == "responses":
            return {"model": "m", "max_output_tokens": max_tokens, "input": messages, **extra}
        return {"model": "m", "max_tokens": max_tokens, "messages": messages, **extra}

    def auth(self, key: str) -> dict[str, str]:
        return (
            {"x-api-key": key} if self.name == "anthropic" else {"authorization": f"Bearer {key}"}
        )

    def client(self, url: str, key: str = "sk-local") -> Any:
        return self.sdk(base_url=url + self.base, api_key=key, max_retries=0)

    def create(self, client: Any, **body: Any) -> Any:
        """A non-streamed generation through the SDK."""
        body = {"model": "m", "max_tokens": 4, "messages": QUESTION, **body}
        if self.name == "anthropic":
            return client.messages.create(**body)
        if self.name == "responses":
            return client.responses.create(
                model=body["model"], input=body["messages"], max_output_tokens=body["max_tokens"]
            )
        return client.chat.completions.create(**body)

    def error(self, response: httpx.Response | httpx2.Response, scenario: str) -> dict[str, Any]:
        """The error of this dialect's envelope (exactly its keys) for `scenario`."""
        body = response.json()
        if self.name == "anthropic":
            assert set(body) == {"type", "error"} and body["type"] == "error"
            assert set(body["error"]) == {"type", "message"}
        else:
            assert set(body) == {"error"}
            assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["type"] == self.types[scenario], body
        error: dict[str, Any] = body["error"]
        return error

    def stream_error(self, sse: str, scenario: str) -> None:
        """The stream ends with this dialect's error frames."""
        if self.name == "responses":
            event, data = last_frames(sse, 1)[0].split("\n")
            last = json.loads(data.removeprefix("data: "))
            assert event == f"event: {last['type']}"
            # The encoder's own failure event, or (it failed outside the encoder) an error event.
            failure = last["response"]["error"] if event == "event: response.failed" else last
            assert event in ("event: response.failed", "event: error")
            assert failure["code"] == "server_error" and failure["message"]
            return
        if self.name == "anthropic":
            event, data = last_frames(sse, 1)[0].split("\n")
            assert event == "event: error"
        else:
            data, done = last_frames(sse, 2)
            assert done == "data: [DONE]"
        error = json.loads(data.removeprefix("data: "))["error"]
        assert error["type"] == self.types[scenario]


ANTHROPIC = Dialect(
    name="anthropic",
    path="/v1/messages",
    base="",
    sdk=anthropic.Anthropic,
    types={
        "auth": "authentication_error",
        "too_large": "request_too_large",
        "overloaded": "overloaded_error",
        "rate_limited": "rate_limit_error",
        "not_found": "not_found_error",
        "internal": "api_error",
        "invalid": "invalid_request_error",
    },
    raises={
        "auth": anthropic.AuthenticationError,
        "too_large": anthropic.RequestTooLargeError,
        "overloaded": anthropic.OverloadedError,
        "rate_limited": anthropic.RateLimitError,
        "not_found": anthropic.NotFoundError,
    },
    overloaded_status=529,
    first_line="event: message_start",
    text_marker="content_block_delta",
)
OPENAI = Dialect(
    name="openai",
    path="/v1/chat/completions",
    base="/v1",
    sdk=openai.OpenAI,
    types={
        "auth": "invalid_request_error",
        "too_large": "invalid_request_error",
        "overloaded": "server_error",
        "rate_limited": "rate_limit_error",
        "not_found": "invalid_request_error",
        "internal": "server_error",
        "invalid": "invalid_request_error",
    },
    raises={
        "auth": openai.AuthenticationError,
        "too_large": openai.APIStatusError,  # the SDK has no class of its own for 413
        "overloaded": openai.InternalServerError,
        "rate_limited": openai.RateLimitError,
        "not_found": openai.NotFoundError,
    },
    overloaded_status=503,
    first_line="data: {",
    text_marker='"content":"',
)
RESPONSES = Dialect(
    name="responses",
    path="/v1/responses",
    base="/v1",
    sdk=openai.OpenAI,
    types=OPENAI.types,
    raises=OPENAI.raises,
    overloaded_status=503,
    first_line="event: response.created",
    text_marker="response.output_text.delta",
)


@pytest.fixture(params=[ANTHROPIC, OPENAI, RESPONSES], ids=lambda d: d.name)
def dialect(request: pytest.FixtureRequest) -> Dialect:
    return request.param  # type: ignore[no-any-return]


def test_a_wrong_key_is_401_and_not_retried(dialect: Dialect, strict_server: RunningServer) -> None:
    wrong = dialect.client(strict_server.url, "sk-wrong")
    with pytest.raises(dialect.raises["auth"]) as caught:
        dialect.create(wrong)
    response = caught.value.response  # type: ignore[attr-defined]
    error = dialect.error(response, "auth")
    if dialect is not ANTHROPIC:
        assert error["code"] == "invalid_api_key"
    assert response.headers["x-should-retry"] == "false"
    listing = httpx.get(f"{strict_server.url}/v1/models", headers=dialect.auth("sk-wrong"))
    assert listing.status_code == 401
    for key_header in (ANTHROPIC.auth("sk-right"), OPENAI.auth("sk-right")):
        right = httpx.post(
            strict_server.url + dialect.path,
            json=dialect.body(QUESTION, 2),
            headers=key_header,
            timeout=60,
        )
        assert right.status_code == 200, "either header carries the key"


def test_more_output_than_the_servers_limit_is_clamped(
    dialect: Dialect, strict_server: RunningServer
) -> None:
    """`--max-output-tokens 4096`: a request for 5,000 in the dialect's own field is answered
    (Claude Code asks for 128,000 and retries a refusal only at limits of some thousands)."""
    response = httpx.post(
        strict_server.url + dialect.path,
        json=dialect.body(QUESTION, 5000),
        headers=dialect.auth("sk-right"),
        timeout=60,
    )
    assert response.status_code == 200, response.text


def test_a_body_over_the_limit_is_413(dialect: Dialect, server: RunningServer) -> None:
    huge = [{"role": "user", "content": "x" * (33 * 1024 * 1024)}]
    with pytest.raises(dialect.raises["too_large"]) as caught:
        dialect.create(dialect.client(server.url), messages=huge, max_tokens=1)
    response = caught.value.response  # type: ignore[attr-defined]
    assert response.status_code == 413
    assert "32 MB" in dialect.error(response, "too_large")["message"]


def test_a_full_queue_is_overloaded_with_retry_after(
    dialect: Dialect, strict_server: RunningServer
) -> None:
    # Its own words per dialect: the other dialect's run would leave this prompt in the prefix
    # cache, and a prompt that prefills at once no longer holds the queue.
    long_prompt = [{"role": "user", "content": f"{dialect.name}: " + "word " * 3000}]
    # The previous dialect's held request may still be in the one-request queue.
    for _ in range(240):
        auth = dialect.auth("sk-right")
        queued = metric(strict_server, "mlxgate_engine_queue_depth", auth)
        if queued == 0 and metric(strict_server, "mlxgate_engine_running", auth) == 0:
            break
        time.sleep(0.5)
    body = dialect.body(long_prompt, 4, stream=True)
    with httpx.Client(timeout=120) as raw:
        request = raw.build_request(
            "POST", strict_server.url + dialect.path, json=body, headers=dialect.auth("sk-right")
        )
        first = raw.send(request, stream=True)  # admitted: it fills the one-request queue
        assert first.status_code == 200
        with pytest.raises(dialect.raises["overloaded"]) as caught:
            dialect.create(dialect.client(strict_server.url, "sk-right"), messages=long_prompt)
        first.close()
    response = caught.value.response  # type: ignore[attr-defined]
    assert response.status_code == dialect.overloaded_status
    dialect.error(response, "overloaded")
    assert int(response.headers["retry-after"]) >= 1


def test_a_client_over_its_share_is_rate_limited(
    dialect: Dialect, limited_server: RunningServer
) -> None:
    # Long prompts keep both requests in flight (prefilling) while the third arrives.
    body = dialect.body([{"role": "user", "content": "word " * 1500}], 4, stream=True)
    url = limited_server.url + dialect.path
    with httpx.Client(timeout=120) as raw:
        busy = [
            raw.send(
                raw.build_request("POST", url, json=body, headers=dialect.auth("client-a")),
                stream=True,
            )
            for _ in range(2)
        ]
        assert [r.status_code for r in busy] == [200, 200]
        with pytest.raises(dialect.raises["rate_limited"]) as caught:
            dialect.create(dialect.client(limited_server.url, "client-a"))
        response = caught.value.response  # type: ignore[attr-defined]
        assert response.headers["retry-after"] == "1"
        dialect.error(response, "rate_limited")
        # Another client is admitted at once (its stream starts; no need to wait for its turn).
        other = raw.send(
            raw.build_request(
                "POST", url, json=dialect.body(QUESTION, 2, stream=True), headers=dialect.auth("b")
            ),
            stream=True,
        )
        assert other.status_code == 200
        lines = other.iter_lines()
        assert next(lines) == "id: 1"
        assert next(lines).startswith(dialect.first_line)
        for response in [*busy, other]:
            response.close()


def test_strict_model_names(dialect: Dialect, aliased_server: RunningServer) -> None:
    client = dialect.client(aliased_server.url)
    names = [SERVED, "claude-local", "gpt-local"]
    assert [model.id for model in client.models.list()] == names
    assert client.models.retrieve("gpt-local").id == "gpt-local"
    reply = dialect.create(client, model="claude-local")
    assert reply.model == SERVED  # responses report the served model
    with pytest.raises(dialect.raises["not_found"]) as caught:
        dialect.create(client, model="claude-opus-5-5")
    response = caught.value.response  # type: ignore[attr-defined]
    assert "claude-opus-5-5" in dialect.error(response, "not_found")["message"]
    assert response.headers["x-should-retry"] == "false"
    with pytest.raises(dialect.raises["not_found"]):
        client.models.retrieve("claude-opus-5-5")


def test_openai_clients_may_leave_out_the_model_and_the_v1(aliased_server: RunningServer) -> None:
    """As llama-server, Ollama and vLLM answer: no `model` is the served model (even with
    `--strict-models`), and every route answers without its `/v1` too."""
    url = aliased_server.url
    for dialect in (OPENAI, RESPONSES):
        body = dialect.body(QUESTION, 2)
        del body["model"]
        for path in (dialect.path, dialect.path.removeprefix("/v1")):
            reply = httpx.post(url + path, json=body, timeout=60)
            assert reply.status_code == 200, (path, reply.text)
            assert reply.json()["model"] == SERVED
    anthropic_body = {**ANTHROPIC.body(QUESTION, 2), "model": SERVED}
    bare = httpx.post(url + "/messages", json=anthropic_body, timeout=60)
    assert bare.status_code == 200 and bare.json()["type"] == "message"
    assert httpx.get(url + "/models").json()["data"][0]["id"] == SERVED
    assert httpx.get(f"{url}/models/gpt-local").json()["id"] == "gpt-local"
    completion = httpx.post(
        url + "/completions", json={"prompt": "Hi there", "max_tokens": 2}, timeout=60
    )
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    assert httpx.post(f"{url}/embeddings", json={}).status_code == 404


def test_unknown_routes_are_404_in_the_dialects_envelope(server: RunningServer) -> None:
    anthropic_404 = httpx.post(f"{server.url}/v1/no-such-route", json={})
    assert anthropic_404.status_code == 404
    ANTHROPIC.error(anthropic_404, "not_found")
    openai_404 = httpx.post(f"{server.url}/v1/embeddings", json={})
    assert openai_404.status_code == 404
    OPENAI.error(openai_404, "not_found")
    for method in ("GET", "DELETE"):
        unknown = httpx.request(method, f"{server.url}/v1/responses/resp_unknown")
        assert unknown.status_code == 404
        assert "resp_unknown" in RESPONSES.error(unknown, "not_found")["message"]


async def _post(in_process: InProcessServer, dialect: Dialect, **body: Any) -> httpx2.Response:
    async with in_process.http_client() as client:
        return await client.post(
            in_process.base_url + dialect.path,
            json=dialect.body(QUESTION, **{"max_tokens": 16, **body}),
            timeout=120,
        )


@pytest.mark.anyio
async def test_an_engine_failure_is_500_and_serving_goes_on(
    dialect: Dialect, in_process: InProcessServer
) -> None:
    in_process.router.fail_after(0)
    failed = await _post(in_process, dialect)
    assert failed.status_code == 500
    assert dialect.error(failed, "internal")["message"] == "generation failed: injected fault"

    # Streamed, the failure comes after the headers and some text: the dialect's error frames.
    in_process.router.fail_after(3)
    streamed = await _post(in_process, dialect, stream=True)
    assert streamed.status_code == 200
    assert dialect.text_marker in streamed.text
    dialect.stream_error(streamed.text, "internal")

    recovered = await _post(in_process, dialect, max_tokens=8)
    assert recovered.status_code == 200


@pytest.mark.anyio
async def test_unexpected_errors_before_and_after_headers(
    dialect: Dialect, in_process: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(prompts.Renderer, "render", broken_render)
        before = await _post(in_process, dialect, max_tokens=8)
    assert before.status_code == 500
    dialect.error(before, "internal")

    with monkeypatch.context() as patch:
        patch.setattr(reader, "events", broken_after_first_frames)
        after = await _post(in_process, dialect, max_tokens=8, stream=True)
    assert after.status_code == 200
    assert after.text.startswith("id: 1\n" + dialect.first_line)
    dialect.stream_error(after.text, "internal")

    assert (await _post(in_process, dialect, max_tokens=8)).status_code == 200


@pytest.mark.anyio
async def test_a_request_can_keep_out_of_speculative_decoding(
    dialect: Dialect, in_process: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = in_process.app.engine
    admit = engine.admit
    speculate: list[bool] = []

    def recording(request: GenerationRequest) -> Any:
        speculate.append(request.speculate)
        return admit(request)

    monkeypatch.setattr(engine, "admit", recording)
    assert (await _post(in_process, dialect, speculative_decoding=False)).status_code == 200
    assert (await _post(in_process, dialect)).status_code == 200
    assert speculate == [False, True]
