"""Tool search on the Messages API: deferred tools stay out of the prompt's tool list until a
search loads them, a loaded tool's definition is rendered in the search's result and the tool
is callable from then on (its call parsed by its schema), without changing the prompt's prefix.

Client-side search (Claude Code's ToolSearch, `tool_reference` blocks in a tool result) and the
server-side search tools (regex and BM25, answered by the stream core with a `server_tool_use`
and a `tool_search_tool_result` block, the turn paused), through the official anthropic SDK and
the real Claude Code CLI against forced-output models (support/forced.py) in Qwen3-Coder's XML
format, which types a call's parameters by the tool's schema."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from anthropic.types import (
    MessageParam,
    ToolParam,
    ToolSearchToolBm25_20251119Param,
    ToolSearchToolRegex20251119Param,
    ToolUnionParam,
)
from anthropic.types.beta import BetaMessageParam, BetaServerToolUseBlock, BetaToolUseBlock

from mlxgate import prompts
from mlxgate.api.anthropic.requests import MessagesRequest, conversation
from support.agents import run_claude_code
from support.forced import TOOL_RESULT, Script, call_markup, forced_model_dir, serve_args, tokenizer
from support.servers import RunningServer, start_server, stop_server

FAMILY = "qwen3-coder"
WEATHER: ToolParam = {
    "name": "get_weather",
    "description": "Forecast the weather for a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "The city"},
            "days": {"type": "integer", "description": "How many days ahead"},
        },
        "required": ["city"],
    },
    "defer_loading": True,
}
EMAIL: ToolParam = {
    "name": "send_email",
    "description": "Send an email message.",
    "input_schema": {"type": "object", "properties": {"to": {"type": "string"}}},
    "defer_loading": True,
}
# Claude Code's client-side search tool (its description trimmed).
TOOL_SEARCH: ToolParam = {
    "name": "ToolSearch",
    "description": "Fetches full schema definitions for deferred tools so they can be called.",
    "input_schema": {
        "type": "object",
        "properties": {"query": {"type": "string"}, "max_results": {"type": "number"}},
        "required": ["query"],
    },
}
REGEX: ToolSearchToolRegex20251119Param = {
    "type": "tool_search_tool_regex_20251119",
    "name": "tool_search_tool_regex",
}
BM25: ToolSearchToolBm25_20251119Param = {
    "type": "tool_search_tool_bm25_20251119",
    "name": "tool_search_tool_bm25",
}
BETAS = ["advanced-tool-use-2025-11-20"]
# What the prompt holds only once get_weather's definition is in a tool result.
WEATHER_LOADED = '<tool_response>\n<functions>\n<function>{"description": "Forecast the weather'
FORECAST = "Sunny and 25 degrees."
ANSWER = "It will be sunny."


def converted(**body: Any) -> prompts.Conversation:
    return conversation(MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **body}))


@pytest.fixture(scope="module")
def renderer() -> prompts.Renderer:
    return prompts.Renderer(tokenizer(FAMILY))


def schemas(prompt: prompts.Prompt) -> dict[str, Any]:
    return {name: json.loads(schema) for name, schema in prompt.reply.tools}


def client_search_turns(*names: str) -> list[dict[str, Any]]:
    """A ToolSearch call and its result, `tool_reference` blocks and Claude Code's text."""
    references = [{"type": "tool_reference", "tool_name": name} for name in names]
    return [
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "ToolSearch",
                    "input": {"query": "select:" + ",".join(names)},
                }
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": references},
                {"type": "text", "text": "Tool loaded."},
            ],
        },
    ]


def test_a_tool_reference_renders_the_definition_and_makes_the_tool_callable(
    renderer: prompts.Renderer,
) -> None:
    question = {"role": "user", "content": "What is the weather in Paris?"}
    tools = [TOOL_SEARCH, WEATHER, EMAIL]
    first = renderer.render(converted(tools=tools, messages=[question]))
    assert "get_weather" not in first.text and "send_email" not in first.text
    assert set(schemas(first)) == {"ToolSearch"}

    loaded = converted(tools=tools, messages=[question, *client_search_turns("get_weather")])
    assert [t["function"]["name"] for t in loaded.tools] == ["ToolSearch"]
    assert [t["function"]["name"] for t in loaded.loaded_tools] == ["get_weather"]
    second = renderer.render(loaded)
    definition = {
        "description": WEATHER["description"],
        "name": "get_weather",
        "parameters": WEATHER["input_schema"],
    }
    result = f"<functions>\n<function>{json.dumps(definition)}</function>\n</functions>"
    assert f"<tool_response>\n{result}\n</tool_response>" in second.text
    assert second.text.count("get_weather") == 2, "in the result only, not in the tool list"
    # Listed as before: the first prompt (up to its generation prompt) opens the second.
    opening = first.text.removesuffix("<|im_start|>assistant\n")
    assert second.text.startswith(opening)
    assert schemas(second)["get_weather"] == WEATHER["input_schema"]
    assert second.reply.markup is renderer.format.markup_tools
    forced = renderer.render(
        converted(
            tools=tools,
            tool_choice={"type": "tool", "name": "get_weather"},
            messages=[question, *client_search_turns("get_weather")],
        )
    )
    assert forced.text.endswith("<tool_call>\n<function=get_weather>\n")


def test_a_tool_reference_to_an_unknown_tool_is_text_not_an_error() -> None:
    loaded = converted(
        tools=[TOOL_SEARCH, WEATHER],
        messages=[
            {"role": "user", "content": "Load them."},
            *client_search_turns("NoSuchTool", "get_weather"),
        ],
    )
    result = next(m["content"] for m in loaded.messages if m["role"] == "tool")
    assert result.startswith("<functions>\n<function>{")
    assert result.endswith(
        "</functions>\nNo tool named 'NoSuchTool' is available: the request's tools do not "
        "define it."
    )
    assert [t["function"]["name"] for t in loaded.loaded_tools] == ["get_weather"]


def test_the_server_search_tool_lists_the_deferred_names_not_their_schemas(
    renderer: prompts.Renderer,
) -> None:
    for declared, kind in ((REGEX, "regular expression"), (BM25, "BM25")):
        search = converted(
            tools=[WEATHER, declared, EMAIL], messages=[{"role": "user", "content": "Hi"}]
        )
        [function] = search.tools
        assert function["function"]["name"] == declared["name"]
        description = function["function"]["description"]
        assert kind in description
        assert description.endswith("Deferred tools:\n- get_weather\n- send_email")
        assert function["function"]["parameters"]["required"] == ["query"]
        prompt = renderer.render(search)
        assert "Forecast the weather" not in prompt.text
        assert set(schemas(prompt)) == {declared["name"]}


def paused_turn(*blocks: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "assistant", "content": list(blocks)}]


def test_server_search_blocks_replay_as_a_call_and_its_result() -> None:
    call = {
        "type": "server_tool_use",
        "id": "srvtoolu_1",
        "name": "tool_search_tool_regex",
        "input": {"query": "weather"},
    }
    found = {
        "type": "tool_search_tool_result",
        "tool_use_id": "srvtoolu_1",
        "content": {
            "type": "tool_search_tool_search_result",
            "tool_references": [{"type": "tool_reference", "tool_name": "get_weather"}],
        },
    }
    paused = converted(
        tools=[REGEX, WEATHER, EMAIL],
        messages=[
            {"role": "user", "content": "Weather?"},
            *paused_turn({"type": "text", "text": "Searching."}, call, found),
        ],
    )
    assert [m["role"] for m in paused.messages] == ["user", "assistant", "tool"]
    assistant, result = paused.messages[1:]
    assert assistant["content"] == "Searching."
    [replayed] = assistant["tool_calls"]
    assert replayed["function"] == {"name": "tool_search_tool_regex", "arguments": call["input"]}
    assert result["tool_call_id"] == "srvtoolu_1"
    assert result["content"].startswith('<functions>\n<function>{"description": "Forecast')
    assert [t["function"]["name"] for t in paused.loaded_tools] == ["get_weather"]

    error = {
        **found,
        "content": {
            "type": "tool_search_tool_result_error",
            "error_code": "invalid_tool_input",
            "error_message": "invalid regular expression",
        },
    }
    failed = converted(
        tools=[REGEX, WEATHER],
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [call, error, {"type": "text", "text": "Hm"}]},
        ],
    )
    assert [m["role"] for m in failed.messages] == ["user", "assistant", "tool", "assistant"]
    assert failed.messages[2]["content"] == "Error: invalid_tool_input: invalid regular expression"
    assert failed.messages[3] == {"role": "assistant", "content": "Hm"}
    assert failed.loaded_tools == []
    undeclared = converted(
        tools=[WEATHER],
        messages=[{"role": "user", "content": "Weather?"}, *paused_turn(call, found)],
    )
    assert [m["role"] for m in undeclared.messages] == ["user", "assistant", "tool"]


# A server whose model, in order of precedence: answers a forecast; calls get_weather once
# its definition is in the prompt (typed: days is an integer); searches with a bad regex, with
# BM25, under a forced tool_choice (the call's opening is in the prompt), or with Claude Code's
# ToolSearch, as the user's first word asks; otherwise searches by regex.
def search_call(name: str, query: str) -> str:
    return call_markup(FAMILY, name, {"query": query})


SCRIPTS = [
    Script(ANSWER, when=f"{TOOL_RESULT[FAMILY]}\nSunny and 25"),
    Script(call_markup(FAMILY, "get_weather", {"city": "Paris", "days": 3}), when=WEATHER_LOADED),
    Script(search_call("tool_search_tool_regex", "(unclosed"), when="Broken"),
    Script(search_call("tool_search_tool_bm25", "weather forecast"), when="Natural"),
    Script(
        search_call("tool_search_tool_regex", "weather").removeprefix(
            "<tool_call>\n<function=tool_search_tool_regex>\n"
        ),
        when="Forced",
    ),
    Script(search_call("ToolSearch", "select:get_weather"), when="Client"),
    Script(search_call("tool_search_tool_regex", "weather")),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("tool-search")
    running = start_server(tmp, *serve_args(forced_model_dir(tmp, FAMILY, SCRIPTS)))
    yield running
    stop_server(running)


@pytest.fixture
def client(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="sk-local", max_retries=0)


def create(client: anthropic.Anthropic, stream: bool, **body: Any) -> Any:
    """A beta message, streamed (and checked to stream its blocks as Anthropic does) or not."""
    if not stream:
        return client.beta.messages.create(model="local", max_tokens=256, betas=BETAS, **body)
    with client.beta.messages.stream(model="local", max_tokens=256, betas=BETAS, **body) as events:
        seen = list(events)
        final = events.get_final_message()
    starts = [e.content_block for e in seen if e.type == "content_block_start"]
    assert [b.type for b in starts] == [b.type for b in final.content]
    for index, block in enumerate(final.content):
        deltas = [
            e.delta.partial_json
            for e in seen
            if e.type == "content_block_delta"
            and e.index == index
            and e.delta.type == "input_json_delta"
        ]
        if block.type in ("tool_use", "server_tool_use"):
            start = starts[index]
            assert isinstance(start, (BetaToolUseBlock, BetaServerToolUseBlock)), start
            assert start.input == {} and len(deltas) > 1, "the input streams"
            assert json.loads("".join(deltas)) == block.input
        else:
            assert not deltas
        if block.type == "tool_search_tool_result":
            assert starts[index] == block, "the result comes whole in its start"
    return final


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not streamed"])
@pytest.mark.parametrize("search", [REGEX, BM25], ids=["regex", "bm25"])
def test_a_server_search_pauses_the_turn_and_the_continuation_calls_the_found_tool(
    client: anthropic.Anthropic,
    search: ToolSearchToolRegex20251119Param | ToolSearchToolBm25_20251119Param,
    stream: bool,
) -> None:
    asking = "Weather in Paris?" if search is REGEX else "Natural question: weather in Paris?"
    messages: list[BetaMessageParam] = [{"role": "user", "content": asking}]
    tools: list[ToolUnionParam] = [search, WEATHER, EMAIL]
    paused = create(client, stream, tools=tools, messages=messages)
    assert paused.stop_reason == "pause_turn"
    call, result = paused.content
    assert call.type == "server_tool_use" and call.id.startswith("srvtoolu_")
    assert call.name == search["name"]
    assert call.input == {"query": "weather" if search is REGEX else "weather forecast"}
    assert result.type == "tool_search_tool_result" and result.tool_use_id == call.id
    assert result.content.type == "tool_search_tool_search_result"
    assert [r.tool_name for r in result.content.tool_references] == ["get_weather"]
    counted = client.beta.messages.count_tokens(
        model="local", betas=BETAS, tools=tools, messages=messages
    ).input_tokens
    assert paused.usage.input_tokens + paused.usage.cache_read_input_tokens == counted
    assert paused.usage.output_tokens > 5

    messages.append({"role": "assistant", "content": paused.content})
    went_on = create(client, stream, tools=tools, messages=messages)
    assert went_on.stop_reason == "tool_use"
    [use] = went_on.content
    assert (use.type, use.name, use.input) == (
        "tool_use",
        "get_weather",
        {"city": "Paris", "days": 3},
    )
    assert went_on.usage.cache_read_input_tokens >= counted - 1, (
        "the paused turn's prefix is reused"
    )

    messages += [
        {"role": "assistant", "content": went_on.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": FORECAST}],
        },
    ]
    done = create(client, stream, tools=tools, messages=messages)
    assert done.stop_reason == "end_turn"
    assert done.content[0].text == ANSWER


def test_a_bad_regex_is_an_error_result(client: anthropic.Anthropic) -> None:
    message = create(
        client,
        True,
        tools=[REGEX, WEATHER],
        messages=[{"role": "user", "content": "Broken pattern: find the weather tool."}],
    )
    assert message.stop_reason == "pause_turn"
    call, result = message.content
    assert call.input == {"query": "(unclosed"}
    assert result.content.type == "tool_search_tool_result_error"
    assert result.content.error_code == "invalid_tool_input"
    assert "regular expression" in result.content.error_message


def test_tool_choice_can_force_the_search(client: anthropic.Anthropic) -> None:
    message = create(
        client,
        False,
        tools=[REGEX, WEATHER, EMAIL],
        tool_choice={"type": "tool", "name": "tool_search_tool_regex"},
        messages=[{"role": "user", "content": "Forced search for the weather tool."}],
    )
    assert message.stop_reason == "pause_turn"
    call, result = message.content
    assert (call.name, call.input) == ("tool_search_tool_regex", {"query": "weather"})
    assert [r.tool_name for r in result.content.tool_references] == ["get_weather"]


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not streamed"])
def test_a_client_search_result_makes_its_tool_callable(
    client: anthropic.Anthropic, stream: bool
) -> None:
    tools: list[ToolUnionParam] = [TOOL_SEARCH, WEATHER, EMAIL]
    messages: list[MessageParam] = [
        {"role": "user", "content": "Client side: what is the weather in Paris?"}
    ]
    without_deferred = client.messages.count_tokens(
        model="local", tools=[TOOL_SEARCH], messages=messages
    ).input_tokens
    counted = client.messages.count_tokens(model="local", tools=tools, messages=messages)
    assert counted.input_tokens == without_deferred, "deferred tools are not in the prompt"
    search = create(client, stream, tools=tools, messages=messages)
    [use] = search.content
    assert (use.name, use.input) == ("ToolSearch", {"query": "select:get_weather"})
    messages += [
        {"role": "assistant", "content": search.content},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,
                    "content": [{"type": "tool_reference", "tool_name": "get_weather"}],
                },
                {"type": "text", "text": "Tool loaded."},
            ],
        },
    ]
    found = create(client, stream, tools=tools, messages=messages)
    assert found.stop_reason == "tool_use"
    [call] = found.content
    assert (call.name, call.input) == ("get_weather", {"city": "Paris", "days": 3})
    assert found.usage.cache_read_input_tokens > counted.input_tokens - 8


# A stdio MCP server of one tool, as little of the protocol as Claude Code needs: its `add`
# takes integers only, so a call whose arguments were parsed as text fails.
MCP_SERVER = """
import json
import sys

TOOL = {
    "name": "add_numbers",
    "description": "Add two integers.",
    "inputSchema": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}
for line in sys.stdin:
    message = json.loads(line)
    if "id" not in message:
        continue
    method, params = message["method"], message.get("params") or {}
    reply = {"jsonrpc": "2.0", "id": message["id"]}
    if method == "initialize":
        reply["result"] = {
            "protocolVersion": params["protocolVersion"],
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "demo", "version": "1"},
        }
    elif method == "tools/list":
        reply["result"] = {"tools": [TOOL]}
    elif method == "tools/call":
        a, b = (params["arguments"].get(k) for k in "ab")
        typed = type(a) is int and type(b) is int
        text = str(a + b) if typed else f"not integers: {a!r}, {b!r}"
        reply["result"] = {"content": [{"type": "text", "text": text}], "isError": not typed}
    elif method == "ping":
        reply["result"] = {}
    else:
        reply["error"] = {"code": -32601, "message": f"no method {method}"}
    print(json.dumps(reply), flush=True)
"""
ADD = "mcp__demo__add_numbers"


@pytest.fixture(scope="module")
def claude_code_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The model searches for the MCP tool with Claude Code's ToolSearch, calls it once its
    definition is in the prompt, and answers with its result."""
    tmp = tmp_path_factory.mktemp("claude-tool-search")
    scripts = [
        Script("The sum is 42.", when=f"{TOOL_RESULT[FAMILY]}\n42"),
        Script(
            call_markup(FAMILY, ADD, {"a": 19, "b": 23}),
            when='<tool_response>\n<functions>\n<function>{"description": "Add two integers',
        ),
        Script(call_markup(FAMILY, "ToolSearch", {"query": f"select:{ADD}", "max_results": 5})),
    ]
    running = start_server(tmp, *serve_args(forced_model_dir(tmp, FAMILY, scripts)))
    yield running
    stop_server(running)


def test_claude_code_loads_a_deferred_mcp_tool_and_runs_it(
    claude_code_server: RunningServer, tmp_path: Path
) -> None:
    """Claude Code (tool search on, its default) defers the MCP server's tool; the model's
    ToolSearch call loads it, the next request's tool_reference renders its definition (the
    script that calls it matches only then), the call is parsed with its integer arguments, and
    Claude Code runs it on the MCP server and sends back 42."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    (tmp_path / "mcp_server.py").write_text(MCP_SERVER)
    config = {
        "mcpServers": {
            "demo": {"command": sys.executable, "args": [str(tmp_path / "mcp_server.py")]}
        }
    }
    (tmp_path / "mcp.json").write_text(json.dumps(config))
    run = run_claude_code(
        claude_code_server,
        workdir,
        "-p",
        "Add 19 and 23 with the demo tool.",
        "--output-format",
        "json",
        "--mcp-config",
        str(tmp_path / "mcp.json"),
        "--strict-mcp-config",
        "--allowedTools",
        ADD,
        "--max-turns",
        "5",  # a script that never matched would loop
    )
    assert run.returncode == 0, run.stdout + run.stderr + claude_code_server.log()[-3000:]
    result = json.loads(run.stdout)
    assert result["result"] == "The sum is 42.", result
    assert result["num_turns"] >= 3, result
