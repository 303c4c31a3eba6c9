"""Third-party clients against a real mlxgate with its embedded model: LiteLLM, the OpenAI Agents
SDK, pydantic-ai, LangChain (langchain-openai, langchain-anthropic), httpx-sse, and the openai
SDK as the keep-alive issue reproduced it, each at its newest release (.venv-compat, `make
compat`).

Every request is a fresh prompt of 750+ words (no two tests share one, and the server's prefix
cache is off), prefilled over about 3 s on an idle machine while the server sends a keep-alive
each second. Each test shows from the bytes on the wire (conftest.Relay) that the stream carried
a keep-alive before its first token and ran to its end, and that what the client hands back
(text, tool call, structured object) is what the server sent. The model is tiny, so answers are
weak, but the protocol is exact: forced tool calls and JSON-schema replies are held to their
schema by the server's grammar, so they always parse and validate.
"""

from __future__ import annotations

import asyncio
import functools
import json
import operator
import random
from typing import Any, Literal

import agents
import httpx
import litellm
import pydantic_ai
import pytest
from agents import (
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
)
from httpx_sse import connect_sse
from langchain_anthropic import ChatAnthropic
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI, OpenAI
from pydantic import BaseModel, ConfigDict
from pydantic_ai import NativeOutput
from pydantic_ai.models.anthropic import AnthropicModel
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.anthropic import AnthropicProvider
from pydantic_ai.providers.openai import OpenAIProvider

from conftest import Server, Wire

MAX_TOKENS = 20


class City(BaseModel):
    """The city the notes are about."""

    # additionalProperties: false in the schema, which the server's grammar holds to as it holds
    # to the rest; without it the model may add keys of its own until max_tokens.
    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Rome", "Oslo", "Lima"]


TOOL_NAME = "record_city"
TOOL = {  # the OpenAI form, which LiteLLM and both LangChain models take
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Record the city the notes are about.",
        "parameters": City.model_json_schema(),
    },
}
# Why the answer ended, in OpenAI's words (LiteLLM reports Anthropic's stop reasons this way).
OPENAI_FINISH = {"end_turn": "stop", "max_tokens": "length", "tool_use": "tool_calls"}
OPENAI = ("openai", "/chat/completions")
ANTHROPIC = ("anthropic", "/v1/messages")

_PEOPLE = ["Ada", "Bruno", "Chidi", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Jun"]
_PLACES = ["north dock", "cold store", "loading bay", "east yard", "packing hall", "rail siding"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def fresh_prompt(topic: str, question: str, words: int = 750) -> str:
    """About `words` words of a warehouse log on `topic` that no other test sends, then the
    question: 750 words are ~1,300 tokens."""
    rng = random.Random(topic)
    sentences = [f"This is the {topic} log, kept in Paris."]
    count = len(sentences[0].split())
    while count < words:
        sentence = (
            f"On {rng.choice(_DAYS)} {rng.choice(_PEOPLE)} moved {rng.randint(2, 99)} crates of "
            f"{topic} from the {rng.choice(_PLACES)} to shelf {rng.randint(1, 400)}."
        )
        sentences.append(sentence)
        count += len(sentence.split())
    return " ".join(sentences) + f"\n\n{question}"


def city_question(topic: str) -> str:
    return fresh_prompt(topic, "In which city is this log kept? Answer with the city's name.")


def assert_called_with_a_city(arguments: dict[str, Any], stream_arguments: str) -> None:
    """The client's parsed arguments are the ones streamed, and a whole City (not cut short)."""
    assert arguments == json.loads(stream_arguments)
    City.model_validate(arguments)


# LiteLLM: the openai/ provider (Chat Completions) and the anthropic/ provider (Messages), each
# pointed at the server with api_base.


def litellm_stream(provider: str, server: Server, prompt: str, **params: Any) -> list[Any]:
    return list(
        litellm.completion(
            model=f"{provider}/smollm2",
            api_base=server.v1 if provider == "openai" else server.root,
            api_key="sk-local",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=MAX_TOKENS,
            stream=True,
            **params,
        )
    )


def finish_reasons(chunks: list[Any]) -> list[str]:
    return [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]


@pytest.mark.parametrize(("provider", "path"), [OPENAI, ANTHROPIC])
def test_litellm_streams_text(server: Server, wire: Wire, provider: str, path: str) -> None:
    chunks = litellm_stream(provider, server, city_question(f"litellm {provider}"))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = finish_reasons(chunks)
    (stream,) = wire.streams(path)
    assert text == stream.text() != ""
    assert finish == [OPENAI_FINISH.get(stream.finish() or "", stream.finish())]


@pytest.mark.parametrize(("provider", "path"), [OPENAI, ANTHROPIC])
def test_litellm_streams_a_forced_tool_call(
    server: Server, wire: Wire, provider: str, path: str
) -> None:
    chunks = litellm_stream(
        provider,
        server,
        city_question(f"litellm {provider} tool"),
        tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": TOOL_NAME}},
    )
    calls = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    finish = finish_reasons(chunks)
    (stream,) = wire.streams(path)
    assert {call.function.name for call in calls if call.function.name} == {TOOL_NAME}
    arguments = "".join(call.function.arguments or "" for call in calls)
    assert_called_with_a_city(json.loads(arguments), stream.tool_arguments())
    assert finish == ["tool_calls"]


# The OpenAI Agents SDK: an agent on the Responses API and one on Chat Completions, over an
# AsyncOpenAI client pointed at the server, run streamed (tracing off: it would export to
# api.openai.com).


@pytest.mark.parametrize(
    ("api", "path"), [("responses", "/responses"), ("chat", "/chat/completions")]
)
def test_openai_agents_stream_a_run(server: Server, wire: Wire, api: str, path: str) -> None:
    async def run() -> tuple[Any, list[Any]]:
        client = AsyncOpenAI(base_url=server.v1, api_key="sk-local", max_retries=0)
        model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
        agent = agents.Agent(
            name="clerk",
            instructions="You answer questions about warehouse logs.",
            model=model_class(model="smollm2", openai_client=client),
            model_settings=ModelSettings(max_tokens=MAX_TOKENS),
        )
        result = Runner.run_streamed(
            agent, city_question(f"agents {api}"), run_config=RunConfig(tracing_disabled=True)
        )
        events = [event async for event in result.stream_events()]
        await client.close()
        return result, events

    result, events = asyncio.run(run())
    (stream,) = wire.streams(path)
    assert result.is_complete
    assert any(event.type == "raw_response_event" for event in events)
    assert result.final_output == stream.text() != ""


# pydantic-ai: the OpenAI chat model and the Anthropic model through their providers.


def pydantic_ai_model(server: Server, provider: str) -> Any:
    if provider == "openai":
        return OpenAIChatModel(
            "smollm2", provider=OpenAIProvider(base_url=server.v1, api_key="sk-local")
        )
    return AnthropicModel(
        "smollm2", provider=AnthropicProvider(base_url=server.root, api_key="sk-local")
    )


@pytest.mark.parametrize(("provider", "path"), [OPENAI, ANTHROPIC])
def test_pydantic_ai_streams_text(server: Server, wire: Wire, provider: str, path: str) -> None:
    async def run() -> tuple[list[str], str]:
        agent = pydantic_ai.Agent(
            pydantic_ai_model(server, provider), model_settings={"max_tokens": MAX_TOKENS}
        )
        async with agent.run_stream(city_question(f"pydantic-ai {provider}")) as result:
            deltas = [delta async for delta in result.stream_text(delta=True)]
            return deltas, await result.get_output()

    deltas, output = asyncio.run(run())
    (stream,) = wire.streams(path)
    assert "".join(deltas) == output == stream.text() != ""


@pytest.mark.parametrize(
    ("provider", "mode", "path"),
    [
        ("openai", "tool", "/chat/completions"),
        ("openai", "native", "/chat/completions"),
        ("anthropic", "tool", "/v1/messages"),
    ],
)
def test_pydantic_ai_streams_structured_output(
    server: Server, wire: Wire, provider: str, mode: str, path: str
) -> None:
    """Tool output (pydantic-ai's default: an output tool that the request forces with
    tool_choice `required` / `any`, which mlxgate holds to the tool's schema) on both providers,
    and native output (`response_format` json_schema) on OpenAI. pydantic-ai offers native
    output on Anthropic only for the Claude models it knows to have it."""

    async def run() -> City:
        agent = pydantic_ai.Agent(
            pydantic_ai_model(server, provider),
            output_type=City if mode == "tool" else NativeOutput(City),
            model_settings={"max_tokens": MAX_TOKENS},
        )
        question = city_question(f"pydantic-ai {provider} {mode} output")
        async with agent.run_stream(question) as result:
            return await result.get_output()

    city = asyncio.run(run())
    (stream,) = wire.streams(path)
    assert isinstance(city, City)
    assert City.model_validate_json(stream.tool_arguments() or stream.text()) == city


# LangChain: ChatOpenAI and ChatAnthropic, streamed: text, a tool forced by name, structured
# output.


def langchain_model(server: Server, provider: str) -> Any:
    if provider == "openai":
        return ChatOpenAI(
            model="smollm2", base_url=server.v1, api_key="sk-local", max_tokens=MAX_TOKENS
        )
    return ChatAnthropic(
        model="smollm2", base_url=server.root, api_key="sk-local", max_tokens=MAX_TOKENS
    )


@pytest.mark.parametrize(("provider", "path"), [OPENAI, ANTHROPIC])
def test_langchain_streams_text(server: Server, wire: Wire, provider: str, path: str) -> None:
    chunks = list(langchain_model(server, provider).stream(city_question(f"langchain {provider}")))
    message = functools.reduce(operator.add, chunks)
    (stream,) = wire.streams(path)
    assert message.text == stream.text() != ""


@pytest.mark.parametrize(("provider", "path"), [OPENAI, ANTHROPIC])
def test_langchain_streams_a_forced_tool_call(
    server: Server, wire: Wire, provider: str, path: str
) -> None:
    model = langchain_model(server, provider).bind_tools([TOOL], tool_choice=TOOL_NAME)
    chunks = list(model.stream(city_question(f"langchain {provider} tool")))
    message = functools.reduce(operator.add, chunks)
    (stream,) = wire.streams(path)
    (call,) = message.tool_calls
    assert call["name"] == TOOL_NAME
    assert_called_with_a_city(call["args"], stream.tool_arguments())
    assert stream.finish() in ("tool_calls", "tool_use")


@pytest.mark.parametrize(
    ("provider", "method", "path"),
    [
        ("openai", "json_schema", "/chat/completions"),
        ("openai", "function_calling", "/chat/completions"),
        ("anthropic", "function_calling", "/v1/messages"),
        ("anthropic", "json_schema", "/v1/messages"),
    ],
)
def test_langchain_streams_structured_output(
    server: Server, wire: Wire, provider: str, method: str, path: str
) -> None:
    """Both methods of each model, each a schema the server holds the reply to: json_schema
    (OpenAI `response_format`, Anthropic `output_config.format`) and function_calling (a tool
    forced by name). ChatOpenAI's default is json_schema, ChatAnthropic's function_calling."""
    model = langchain_model(server, provider).with_structured_output(City, method=method)
    parts = list(model.stream(city_question(f"langchain {provider} {method} output")))
    (stream,) = wire.streams(path)
    assert parts and isinstance(parts[-1], City)
    assert parts[-1] == City.model_validate_json(stream.tool_arguments() or stream.text())


# httpx-sse, what hand-written clients read SSE with: every event of every dialect is JSON (or
# the `[DONE]` that ends an OpenAI stream), keep-alives included.


def sse_request(path: str, prompt: str) -> dict[str, Any]:
    if path == "/v1/completions":
        return {"prompt": prompt, "max_tokens": MAX_TOKENS}
    if path == "/v1/responses":
        return {"input": prompt, "max_output_tokens": MAX_TOKENS}
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS}


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"]
)
def test_httpx_sse_reads_every_event(server: Server, wire: Wire, path: str) -> None:
    request = sse_request(path, city_question(f"httpx-sse {path}"))
    request.update(model="smollm2", stream=True)
    with (
        httpx.Client(base_url=server.root, timeout=600) as client,
        connect_sse(client, "POST", path, json=request) as source,
    ):
        data = [event.data for event in source.iter_sse()]
    (stream,) = wire.streams(path)
    assert [json.loads(d) for d in data if d != "[DONE]"] == stream.events()
    assert (data[-1] == "[DONE]") == path.endswith("completions")


# The keep-alive issue as it was reported: the newest openai SDK configured from the
# environment, a ~2,600-word fresh prompt, a server with the default 10 s keep-alive interval.


def test_openai_sdk_streams_the_reported_request(
    default_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", default_server.v1)
    wire = Wire(default_server.relay)
    # ~7,300 tokens: over 10 s of prefill (the default keep-alive interval) even with the CPU
    # kernels' attention (a 3,650-token prompt takes ~9 s).
    prompt = fresh_prompt("issue", "Summarise the log in one sentence.", words=4200)
    stream = OpenAI().chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=5, stream=True
    )
    chunks = list(stream)
    (sent,) = wire.streams("/chat/completions")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == sent.text()
    assert chunks[-1].choices[0].finish_reason == "length"
