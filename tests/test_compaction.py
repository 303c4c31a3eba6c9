"""Compaction and context editing done by the served model, through the official SDKs.

OpenAI: the Responses API's `compaction_trigger` (Codex's remote compaction) and
`POST /v1/responses/compact` answer with one `compaction` item carrying the model's own summary;
a later request that sends it back renders the summary in place of the conversation it stands
for. Anthropic: the `compaction` parameter and the `compact_20260112` edit answer with a
`compaction` block (then, unless it pauses, the answer from the summary on); the
`clear_tool_uses_20250919` edit clears old tool results; `applied_edits` says what was done.

A forced-output model (support/forced.py) writes the summary when the prompt holds the compaction
instruction, and answers "Resumed." only when the prompt holds a replayed summary."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from openai.types.responses import ResponseCompactionItem, ResponseInputItemParam

from mlxgate._native import compaction_from_encrypted
from mlxgate.api.anthropic.context import CLEARED_RESULT
from mlxgate.api.compaction import INSTRUCTION, SUMMARY_HEADING
from support.forced import Script, forced_model_dir, serve_args
from support.sdk import expect, replayed
from support.servers import RunningServer, start_server, stop_server

SUMMARY = "SUMMARY: the user said hi."
# Whole words, so they encode as inside the prompt.
ASKED = " ".join(INSTRUCTION.split()[:6])
REPLAYED = SUMMARY_HEADING.split(".")[0]
# Long enough for the prefix cache to keep (it keeps whole blocks of tokens).
HI = "hi, " + "I have a long story to tell you about my day. " * 12


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("compaction")
    model = forced_model_dir(
        tmp,
        "qwen3",
        [
            Script("Cleared.", when=CLEARED_RESULT.strip("[]").rstrip(".")),
            Script("Resumed.", when=REPLAYED),
            Script(SUMMARY, when=ASKED),
            Script("Hello there."),
        ],
    )
    running = start_server(tmp, *serve_args(model))
    yield running
    stop_server(running)


@pytest.fixture
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-local", max_retries=0)


def conversation(client: openai.OpenAI) -> list[ResponseInputItemParam]:
    first = client.responses.create(model="local", input=HI)
    assert first.output_text == "Hello there."
    return [{"role": "user", "content": HI}, *(replayed(item) for item in first.output)]


def test_a_compaction_trigger_is_answered_with_one_compaction_item(client: openai.OpenAI) -> None:
    history = conversation(client)
    trigger: ResponseInputItemParam = {"type": "compaction_trigger"}
    response = client.responses.create(model="local", input=[*history, trigger], store=False)
    [item] = response.output
    assert item.type == "compaction"
    assert compaction_from_encrypted(item.encrypted_content) == SUMMARY
    assert response.usage is not None and response.usage.output_tokens > 0
    # The compaction's prompt is the conversation's plus one turn: the conversation's KV is reused.
    assert response.usage.input_tokens_details.cached_tokens > 0

    events = list(client.responses.create(model="local", input=[*history, trigger], stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.type for item in done] == ["compaction"]
    assert expect(ResponseCompactionItem, done[0]).encrypted_content == item.encrypted_content
    assert events[-1].type == "response.completed"


def test_a_replayed_compaction_stands_for_the_conversation(client: openai.OpenAI) -> None:
    history = conversation(client)
    compacted = client.responses.create(
        model="local", input=[*history, {"type": "compaction_trigger"}], store=False
    )
    item = replayed(compacted.output[0])
    turns: list[ResponseInputItemParam] = [
        {"role": "user", "content": "hi"},
        item,
        {"role": "user", "content": "go on"},
    ]
    resumed = client.responses.create(model="local", input=turns)
    assert resumed.output_text == "Resumed."
    # Another server's compaction cannot be read here: it is left out, not refused.
    foreign: ResponseInputItemParam = {
        "type": "compaction",
        "encrypted_content": "gAAAA-openai-blob",
    }
    fresh = client.responses.create(
        model="local", input=[{"role": "user", "content": "hi"}, foreign]
    )
    assert fresh.output_text == "Hello there."


def test_the_compact_endpoint_keeps_the_user_messages_and_adds_the_summary(
    client: openai.OpenAI,
) -> None:
    history = conversation(client)
    compacted = client.responses.compact(model="local", input=history)
    assert compacted.object == "response.compaction"
    kinds = [(item.type, getattr(item, "role", None)) for item in compacted.output]
    assert kinds == [("message", "user"), ("compaction", None)]
    summary = expect(ResponseCompactionItem, compacted.output[-1]).encrypted_content
    assert compaction_from_encrypted(summary) == SUMMARY
    assert compacted.usage.output_tokens > 0


def test_a_trigger_anywhere_but_last_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="compaction_trigger must be the last"):
        client.responses.create(
            model="local",
            input=[{"type": "compaction_trigger"}, {"role": "user", "content": "hi"}],
        )


@pytest.fixture
def claude(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="sk-local", max_retries=0)


def ask(claude: anthropic.Anthropic, stream: bool = False, **fields: Any) -> Any:
    """A beta Messages request on the story, with `fields` in its body."""
    kwargs: Any = {
        "model": "local",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": HI}],
        "extra_body": fields,
    }
    if stream:
        with claude.beta.messages.stream(**kwargs) as events:
            return events.get_final_message()
    return claude.beta.messages.create(**kwargs)


@pytest.mark.parametrize("stream", [False, True])
def test_the_compaction_parameter_answers_with_the_summary_block(
    claude: anthropic.Anthropic, stream: bool
) -> None:
    message = ask(claude, stream, compaction={"type": "summarize"})
    assert [block.type for block in message.content] == ["compaction"]
    assert message.content[0].content == SUMMARY
    assert message.stop_reason == "compaction"
    assert message.usage.output_tokens > 0


def test_a_compact_edit_compacts_only_past_its_trigger_and_may_go_on(
    claude: anthropic.Anthropic,
) -> None:
    def edit(tokens: int, pause: bool) -> dict[str, Any]:
        trigger = {"type": "input_tokens", "value": tokens}
        compact = {"type": "compact_20260112", "trigger": trigger, "pause_after_compaction": pause}
        return {"edits": [compact]}

    untouched = ask(claude, context_management=edit(1_000_000, pause=True))
    assert [block.type for block in untouched.content] == ["text"]
    paused = ask(claude, context_management=edit(10, pause=True))
    assert [block.type for block in paused.content] == ["compaction"]
    assert paused.stop_reason == "compaction"
    for stream in (False, True):
        going_on = ask(claude, stream, context_management=edit(10, pause=False))
        kinds = [
            (b.type, b.content if b.type == "compaction" else b.text) for b in going_on.content
        ]
        assert kinds == [("compaction", SUMMARY), ("text", "Resumed.")]
        assert going_on.stop_reason == "end_turn"


def test_a_replayed_compaction_block_stands_for_what_came_before(
    claude: anthropic.Anthropic,
) -> None:
    compacted = ask(claude, compaction={"type": "summarize"})
    message = claude.beta.messages.create(
        model="local",
        max_tokens=64,
        messages=[
            {"role": "user", "content": "something the summary replaces"},
            {"role": "assistant", "content": [b.model_dump() for b in compacted.content]},
            {"role": "user", "content": "go on"},
        ],
    )
    assert message.content[0].text == "Resumed."  # type: ignore[union-attr]


def test_clear_tool_uses_clears_the_old_results_and_says_so(claude: anthropic.Anthropic) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": HI}]
    for i in range(4):
        call = {"type": "tool_use", "id": f"toolu_{i}", "name": "read", "input": {"n": i}}
        result = {
            "type": "tool_result",
            "tool_use_id": f"toolu_{i}",
            "content": f"page {i}: " + "lorem ipsum " * 40,
        }
        messages += [
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result]},
        ]
    tool = {"name": "read", "description": "Read a page.", "input_schema": {"type": "object"}}

    def edited(trigger: int) -> Any:
        edit = {
            "type": "clear_tool_uses_20250919",
            "trigger": {"type": "tool_uses", "value": trigger},
            "keep": {"type": "tool_uses", "value": 1},
        }
        return claude.beta.messages.create(
            model="local",
            max_tokens=64,
            messages=messages,  # type: ignore[arg-type]
            tools=[tool],  # type: ignore[list-item]
            extra_body={"context_management": {"edits": [edit]}},
        )

    message = edited(trigger=3)
    assert message.content[0].text == "Cleared."
    [applied] = message.context_management.applied_edits
    assert (applied.type, applied.cleared_tool_uses) == ("clear_tool_uses_20250919", 3)
    assert applied.cleared_input_tokens > 0
    # Below its trigger, the edit does nothing and says nothing.
    assert edited(trigger=10).context_management is None
