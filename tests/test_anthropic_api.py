"""Anthropic Messages API, complete: tools, count_tokens, errors, Claude Code's request shapes."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from subprocess import CompletedProcess

import anthropic
import httpx
import pytest
from anthropic.types import MessageParam, ToolParam

from mlxgate import cli
from support.agents import run_claude_code
from support.servers import RunningServer, start_server

BASH_TOOL: ToolParam = {
    "name": "Bash",
    "description": "Executes a bash command and returns its output.",
    "input_schema": {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "The command to run"},
            "description": {"type": "string"},
        },
        "required": ["command"],
        "additionalProperties": False,
    },
}
DEFERRED_TOOL: ToolParam = {
    "name": "DeferredToolPlaceholder",
    "description": "Reserved placeholder; never call this tool.",
    "input_schema": {"type": "object", "properties": {}},
    "defer_loading": True,
}


@pytest.fixture
def client(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="sk-local", max_retries=0)


def test_forced_tool_call_streams_input_json_and_round_trips(client: anthropic.Anthropic) -> None:
    question: MessageParam = {"role": "user", "content": "List the files in the current directory."}
    with client.messages.stream(
        model="claude-test",
        max_tokens=256,
        tools=[BASH_TOOL, DEFERRED_TOOL],
        tool_choice={"type": "tool", "name": "Bash"},
        messages=[question],
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    fragments = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert len(fragments) > 1, "tool arguments stream in fragments as the model writes them"
    tool_use = next(b for b in final.content if b.type == "tool_use")
    assert tool_use.name == "Bash" and tool_use.id.startswith("toolu_")
    assert json.loads("".join(fragments)) == tool_use.input
    assert isinstance(tool_use.input, dict)
    assert final.stop_reason == "tool_use"

    follow_up = client.messages.create(
        model="claude-test",
        max_tokens=48,
        tools=[BASH_TOOL],
        messages=[
            question,
            {"role": "assistant", "content": final.content},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": tool_use.id,
                        "content": "README.md\nsrc\n",
                        "is_error": False,
                    }
                ],
            },
        ],
    )
    assert follow_up.stop_reason in ("end_turn", "tool_use", "max_tokens")
    assert follow_up.content, "the next turn is answered"
    cached = follow_up.usage.cache_read_input_tokens
    assert cached is not None and cached > 0, "the first turn's prefix is reused"


def test_count_tokens_equals_what_generation_reports(client: anthropic.Anthropic) -> None:
    messages: list[MessageParam] = [{"role": "user", "content": "Say something about tools."}]
    counted = client.messages.count_tokens(
        model="claude-test",
        messages=messages,
        tools=[BASH_TOOL],
        system="Be brief.",
    ).input_tokens
    usage = client.messages.create(
        model="claude-test",
        max_tokens=4,
        messages=messages,
        tools=[BASH_TOOL],
        system="Be brief.",
    ).usage
    assert usage.cache_read_input_tokens is not None
    assert usage.input_tokens + usage.cache_read_input_tokens == counted
    without_tools = client.messages.count_tokens(
        model="claude-test", messages=messages
    ).input_tokens
    assert counted > without_tools + 50  # the tool schema is in the prompt


def test_claude_code_message_shapes_are_accepted(
    client: anthropic.Anthropic, server: RunningServer
) -> None:
    """System messages inside `messages` (string, list, empty list), billing header, betas."""
    body = {
        "model": "claude-opus-5-5",
        "max_tokens": 128000,
        "stream": True,
        "system": [
            {
                "type": "text",
                "text": "x-anthropic-billing-header: cc_version=2.1.330.440; cc_entrypoint=sdk-cli;",  # noqa: E501
            },
            {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>\nx\n</system-reminder>\n"},
                    {"type": "text", "text": "say hi"},
                ],
            },
            {"role": "system", "content": [], "output_config": {"effort": "medium"}},
            {"role": "system", "content": "# Environment\ncwd: /tmp"},
        ],
        "tools": [BASH_TOOL, DEFERRED_TOOL],
        "metadata": {"user_id": "x"},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
        "safeguards": [],
    }
    headers = {
        "anthropic-beta": "claude-code-20250219,mid-conversation-tool-changes-2026-07-01",
        "x-api-key": "k",
    }
    url = f"{server.url}/some/prefix/v1/messages?beta=true"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200, response.read()
        seen = b""
        for chunk in response.iter_raw():
            seen += chunk
            if b"content_block_delta" in seen or b"message_stop" in seen:
                break  # max_tokens 128000 was clamped and accepted; no need to wait it out
    assert seen.startswith(b"id: 1\nevent: message_start")
    # The billing header varies per session: it must not change the prompt.
    other = json.loads(json.dumps(body))
    other["system"][0]["text"] = (
        "x-anthropic-billing-header: cc_version=2.1.330.930; cc_entrypoint=sdk-cli;"
    )
    other["messages"][2]["content"] = [{"type": "text", "text": "# Environment\ncwd: /tmp"}]
    count = [
        httpx.post(
            f"{server.url}/v1/messages/count_tokens",
            json={k: v for k, v in b.items() if k != "max_tokens"},
        ).json()
        for b in (body, other)
    ]
    assert count[0] == count[1]


def test_tool_result_with_blocks_and_tool_reference(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model="claude-test",
        max_tokens=8,
        tools=[BASH_TOOL],
        messages=[
            {"role": "user", "content": "Load the WebFetch tool."},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should search.", "signature": ""},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "ToolSearch",
                        "input": {"query": "select:WebFetch"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "tool_reference", "tool_name": "WebFetch"}],
                    },
                    {"type": "text", "text": "Tool loaded."},
                ],
            },
        ],
    )
    assert message.usage.output_tokens >= 1


def test_images_get_a_clear_400(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model="claude-test",
            max_tokens=8,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                        }
                    ],
                }
            ],
        )
    assert "reads text only" in str(caught.value)  # (test_image_inputs.py has the rest)


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_count_tokens_answers_only_served_names_with_strict_models(
    aliased_server: RunningServer,
) -> None:
    client = anthropic.Anthropic(base_url=aliased_server.url, api_key="sk-local", max_retries=0)
    assert client.messages.count_tokens(model="claude-local", messages=QUESTION).input_tokens > 0  # type: ignore[arg-type]
    assert client.models.retrieve("claude-local").type == "model"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-opus-5-5", messages=QUESTION)  # type: ignore[arg-type]


def test_model_alias_must_name_the_served_model(tmp_path: Path) -> None:
    config = cli.parse_config(["--model-alias", "claude-local=SmolLM2-135M-Instruct"])
    assert config.model_aliases == {"claude-local": "SmolLM2-135M-Instruct"}
    assert not config.strict_models
    with pytest.raises(SystemExit):
        cli.parse_config(["--model-alias", "no-equals-sign"])
    with pytest.raises(SystemExit):
        cli.parse_config(["--model-alias", "a=SmolLM2-135M-Instruct", "--model-alias", "a=b"])
    with pytest.raises(RuntimeError) as caught:
        start_server(tmp_path, "--model-alias", "claude-local=Qwen3-4B")
    assert "no model is served as 'Qwen3-4B' (served: 'SmolLM2-135M-Instruct')" in str(caught.value)


@pytest.fixture
def claude(server: RunningServer, tmp_path: Path) -> Callable[..., CompletedProcess[str]]:
    return partial(run_claude_code, server, tmp_path)


BARE = ["--bare", "--system-prompt", "You are a helpful assistant.", "--tools", "Bash"]


def test_claude_code_bare_prompt_and_continue(
    claude: Callable[..., CompletedProcess[str]],
) -> None:
    first = claude(*BARE, "-p", "What is the capital of France?", "--output-format", "json")
    assert first.returncode == 0, first.stdout + first.stderr
    result = json.loads(first.stdout)
    assert result["is_error"] is False and result["result"].strip()
    assert result["usage"]["input_tokens"] > 300  # the Bash tool schema was rendered

    second = claude(*BARE, "-c", "-p", "And of Germany?", "--output-format", "json")
    assert second.returncode == 0, second.stdout + second.stderr
    again = json.loads(second.stdout)
    assert again["result"].strip()
    assert again["usage"]["cache_read_input_tokens"] > 0


def test_claude_code_default_request_is_too_long_for_8k(
    claude: Callable[..., CompletedProcess[str]],
) -> None:
    run = claude("-p", "say hi", timeout=120)
    assert run.returncode == 1
    assert "Prompt is too long" in run.stdout and "limit 8192" in run.stdout
