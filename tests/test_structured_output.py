"""Structured output: a reply held to a JSON schema by constrained decoding (llguidance), through
the openai SDK, alone and batched beside unconstrained rows, and the errors for schemas the
engine cannot enforce."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
from anthropic.types import MessageParam
from openai.types.chat import (
    ChatCompletionFunctionToolParam,
    ChatCompletionMessageParam,
    ChatCompletionToolChoiceOptionParam,
)
from openai.types.shared_params import FunctionDefinition
from pydantic import BaseModel, Field

from support.sdk import functions
from support.servers import RunningServer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "artist", "doctor"]},
        "languages": {
            "type": "array",
            "items": {"$ref": "#/$defs/language"},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "languages", "address"],
    "additionalProperties": False,
    "$defs": {"language": {"type": "string", "enum": ["en", "fr", "de", "es"]}},
}
ASKED = "Describe a person who lives in Paris, as JSON."
# The same message for each SDK, as each types it.
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": ASKED}]
ASK_CLAUDE: list[MessageParam] = [{"role": "user", "content": ASKED}]
# A bound on every string and array keeps a 135M model's reply inside max_tokens.
MAX_TOKENS = 200


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-local", max_retries=0)


def schema_format(schema: dict[str, Any], strict: bool = True) -> Any:
    return {
        "type": "json_schema",
        "json_schema": {"name": "reply", "schema": schema, "strict": strict},
    }


def test_json_schema_reply_validates(server: RunningServer) -> None:
    for strict in (True, False):
        completion = client(server).chat.completions.create(
            model="local",
            messages=ASK,
            max_tokens=MAX_TOKENS,
            response_format=schema_format(PERSON, strict),
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)


def test_json_object_mode_gives_an_object_and_streams_it(server: RunningServer) -> None:
    stream = client(server).chat.completions.create(
        model="local",
        messages=[{"role": "user", "content": "Give me a JSON object with a greeting."}],
        max_tokens=MAX_TOKENS,
        response_format={"type": "json_object"},
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert isinstance(json.loads(text), dict), text


class Language(BaseModel):
    code: Literal["en", "fr", "de"]
    speakers_millions: int = Field(ge=0, le=2000)


class Country(BaseModel):
    name: str = Field(max_length=24)
    capital: str = Field(max_length=24)
    languages: list[Language] = Field(min_length=1, max_length=2)


def test_the_sdks_parse_helper_gets_its_pydantic_model(server: RunningServer) -> None:
    completion = client(server).chat.completions.parse(
        model="local",
        messages=[{"role": "user", "content": "Describe France."}],
        max_tokens=MAX_TOKENS,
        response_format=Country,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Country)


NUMBERS = {
    "type": "object",
    "properties": {
        "values": {
            "type": "array",
            "items": {"type": "number", "minimum": -10, "maximum": 10},
            "maxItems": 4,
        },
        "ok": {"type": "boolean"},
    },
    "required": ["values", "ok"],
    "additionalProperties": False,
}
PLAIN = [
    "What is the capital of France?",
    "Name three colours.",
    "What is 2+2?",
    "Say hello.",
]


def _ask(server: RunningServer, prompt: str, schema: dict[str, Any] | None) -> str:
    completion = client(server).chat.completions.create(
        model="local",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS if schema else 24,
        temperature=0,
        **({"response_format": schema_format(schema)} if schema else {}),
    )
    return completion.choices[0].message.content or ""


def test_constrained_and_unconstrained_rows_batched_together(server: RunningServer) -> None:
    """16 at once: constrained replies validate; unconstrained ones are what they are alone,
    token for token (greedy), though their neighbours' logits were masked in the same step."""
    alone = [_ask(server, prompt, None) for prompt in PLAIN]
    jobs: list[tuple[str, dict[str, Any] | None]] = [
        *((p, None) for p in PLAIN * 2),
        *((p, PERSON) for p in PLAIN),
        *((p, NUMBERS) for p in PLAIN),
    ]
    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(lambda job: _ask(server, *job), jobs))
    for (prompt, schema), reply in zip(jobs, replies, strict=True):
        if schema is None:
            assert reply == alone[PLAIN.index(prompt)]
        else:
            jsonschema.validate(json.loads(reply), schema)


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"type": "string", "format": "not-a-format"}, "Unknown format: not-a-format"),
        ({"type": "string", "pattern": "(?<=a)b"}, "regex parse error"),
        ({"$ref": "#/$defs/missing"}, "/$defs/missing"),
        ({"type": "object", "properties": {"a": {"type": "wrong"}}}, "wrong"),
    ],
)
def test_a_schema_the_engine_cannot_enforce_is_400(
    server: RunningServer, schema: dict[str, Any], says: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).chat.completions.create(
            model="local",
            messages=ASK,
            max_tokens=8,
            response_format=schema_format(schema),
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "response_format", error
    assert says in error["message"], error


def test_responses_text_format_json_schema(server: RunningServer) -> None:
    response = client(server).responses.create(
        model="local",
        input="Describe a person who lives in Paris, as JSON.",
        max_output_tokens=MAX_TOKENS,
        text={
            "format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
        },
    )
    assert response.status == "completed", response
    jsonschema.validate(json.loads(response.output_text), PERSON)
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).responses.create(
            model="local",
            input="hi",
            text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "wrong"}}},
        )
    assert caught.value.body["param"] == "text.format"  # type: ignore[index]


class Weather(BaseModel):
    city: Literal["Paris", "London", "Rome"]
    sunny: bool
    temperature_celsius: int


def anthropic_client(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="sk-local", max_retries=0)


def test_anthropic_structured_outputs(server: RunningServer) -> None:
    """`output_config.format` (and the beta's top-level `output_format`): the reply's text is the
    schema's JSON; the SDK's `messages.parse` gets its pydantic model."""
    claude = anthropic_client(server)
    parsed = claude.messages.parse(
        model="local",
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": "What is the weather like in Paris?"}],
        output_format=Weather,
    )
    assert isinstance(parsed.parsed_output, Weather), parsed
    message = claude.messages.create(
        model="local",
        max_tokens=MAX_TOKENS,
        messages=ASK_CLAUDE,
        output_config={"format": {"type": "json_schema", "schema": PERSON}},
    )
    assert message.stop_reason == "end_turn", message
    jsonschema.validate(json.loads(message.content[0].text), PERSON)  # type: ignore[union-attr]
    beta = httpx.post(
        f"{server.url}/v1/messages",
        headers={"anthropic-beta": "structured-outputs-2025-11-13"},
        json={
            "model": "local",
            "max_tokens": MAX_TOKENS,
            "messages": ASK,
            "output_format": {"type": "json_schema", "schema": NUMBERS},
        },
        timeout=120,
    ).json()
    jsonschema.validate(json.loads(beta["content"][0]["text"]), NUMBERS)
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(
            model="local",
            max_tokens=8,
            messages=ASK_CLAUDE,
            output_config={"format": {"type": "json_schema", "schema": {"type": "wrong"}}},
        )
    assert caught.value.body["error"]["message"].startswith("output_config.format: ")  # type: ignore[index]


FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Berlin", "Madrid"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
LOOKUP = {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 40}},
    "required": ["query"],
    "additionalProperties": False,
}
RAIN = "Will it rain in Paris this week?"


def test_forced_tool_calls_have_schema_valid_arguments(server: RunningServer) -> None:
    """tool_choice naming a tool, or any tool: the call's arguments validate against its schema
    (Hermes here; tests/test_formats.py holds every format's grammar to the same)."""
    tools: list[ChatCompletionFunctionToolParam] = [
        {"type": "function", "function": {"name": "forecast", "parameters": FORECAST}},
        {"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}},
    ]
    schemas = {"forecast": FORECAST, "lookup": LOOKUP}
    ask: list[ChatCompletionMessageParam] = [{"role": "user", "content": RAIN}]
    choices: list[ChatCompletionToolChoiceOptionParam] = [
        {"type": "function", "function": {"name": "forecast"}},
        "required",
    ]
    for choice in choices:
        completion = client(server).chat.completions.create(
            model="local",
            messages=ask,
            tools=tools,
            tool_choice=choice,
            max_tokens=MAX_TOKENS,
        )
        choice_ = completion.choices[0]
        assert choice_.finish_reason == "tool_calls", choice_
        call = functions(choice_.message)[0]
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    message = anthropic_client(server).messages.create(
        model="local",
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": RAIN}],
        tools=[{"name": "forecast", "input_schema": FORECAST}],
        tool_choice={"type": "tool", "name": "forecast"},
    )
    assert message.stop_reason == "tool_use", message
    jsonschema.validate(message.content[0].input, FORECAST)  # type: ignore[union-attr]


def test_a_strict_tool_the_model_does_not_call_leaves_its_text_unchanged(
    server: RunningServer,
) -> None:
    """`strict: true` with tool_choice auto holds only the calls the model makes (their schemas:
    tests/test_forced_model.py, tests/test_formats.py); a reply in plain text is the same token
    for token (greedy) as without `strict`, on both APIs."""
    ask: list[ChatCompletionMessageParam] = [{"role": "user", "content": RAIN}]
    ask_claude: list[MessageParam] = [{"role": "user", "content": RAIN}]

    def reply(strict: bool) -> tuple[str | None, Any]:
        function: FunctionDefinition = {
            "name": "forecast",
            "parameters": FORECAST,
            "strict": strict,
        }
        completion = client(server).chat.completions.create(
            model="local",
            messages=ask,
            tools=[{"type": "function", "function": function}],
            max_tokens=48,
            temperature=0,
        )
        message = anthropic_client(server).messages.create(
            model="local",
            max_tokens=48,
            messages=ask_claude,
            tools=[{"name": "forecast", "input_schema": FORECAST, "strict": strict}],
            extra_body={"temperature": 0},
        )
        return completion.choices[0].message.content, message.content

    text, blocks = reply(strict=True)
    assert text and (text, blocks) == reply(strict=False)
