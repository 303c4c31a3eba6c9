"""Custom (freeform) tools through the official openai SDK, on the Responses API and Chat
Completions: the call comes back as raw text (`custom_tool_call`, a `custom` tool call), streamed
and not; its input is held to the tool's Lark grammar; a grammar that does not compile is a 400
naming the tool; a call and its output replay into the next turn.

Forced-output models write the calls (support/forced.py): Qwen3-Coder's XML format, which writes a
string parameter raw, and Qwen3's Hermes JSON, which writes it in a JSON string (where the
grammar is held through the escaping, formats/escaped_grammar.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import llguidance
import openai
import pytest
from openai.types.chat import ChatCompletionCustomToolParam, ChatCompletionMessageParam
from openai.types.responses import (
    CustomToolParam,
    ResponseCompletedEvent,
    ResponseCustomToolCall,
    ResponseCustomToolCallOutputParam,
)
from openai.types.shared_params.custom_tool_input_format import Grammar

from mlxgate.formats.escaped_grammar import escaped
from support.forced import TOOL_RESULT, Script, call_markup, forced_model_dir, serve_args, tokenizer
from support.sdk import expect, replayed
from support.servers import RunningServer, start_server, stop_server

APPLY_PATCH_GRAMMAR = (Path(__file__).parent / "fixtures" / "apply_patch.lark").read_text()
PATCH = '*** Begin Patch\n*** Add File: hello.txt\n+Hello, "world" \\o/\n*** End Patch'
APPLY_PATCH: CustomToolParam = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_GRAMMAR},
}
COLOURS = 'start: "red" | "green" | "blue"'
# The model's script paints purple; a grammar of three colours must win.
PAINT: CustomToolParam = {"type": "custom", "name": "paint", "description": "Paint the wall."}
ANSWER = "The file is written."


@pytest.fixture(scope="module", params=["qwen3-coder", "qwen3"])
def family_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, RunningServer]]:
    family = request.param
    tmp = tmp_path_factory.mktemp(f"custom-{family}")
    # A forced call's prompt ends with the call's opening: the script continues from there.
    paint = call_markup(family, "paint", {"input": "purple"})
    opening = {
        "qwen3-coder": "<tool_call>\n<function=paint>\n",
        "qwen3": '<tool_call>\n{"name": "paint", "arguments": ',
    }[family]
    model = forced_model_dir(
        tmp,
        family,
        [
            Script(ANSWER, when=TOOL_RESULT[family]),
            Script(paint.removeprefix(opening), when="Paint"),
            Script(call_markup(family, "apply_patch", {"input": PATCH})),
        ],
    )
    server = start_server(tmp, *serve_args(model))
    yield family, server
    stop_server(server)


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-local", max_retries=0)


def chat_tool(custom: Mapping[str, object]) -> Any:
    """A custom tool as Chat Completions takes it, `{"type": "custom", "custom": {...}}`, with
    its format in the Responses API's flat shape, which mlxgate also reads on Chat Completions
    (the SDK declares the grammar one level down, `format.grammar`: `nested_chat_tool`)."""
    return {"type": "custom", "custom": custom}


def nested_chat_tool(tool: CustomToolParam) -> ChatCompletionCustomToolParam:
    """`tool` as the SDK types a Chat Completions custom tool: the grammar in `format.grammar`."""
    custom: Any = {k: v for k, v in tool.items() if k != "type"}
    if (format := tool.get("format")) and format["type"] == "grammar":
        grammar = {"syntax": format["syntax"], "definition": format["definition"]}
        custom["format"] = {"type": "grammar", "grammar": grammar}
    return {"type": "custom", "custom": custom}


def test_responses_answers_a_custom_tool_call_with_its_raw_input(
    family_server: tuple[str, RunningServer],
) -> None:
    _, server = family_server
    response = client(server).responses.create(
        model="local", input="Write hello.txt.", tools=[APPLY_PATCH]
    )
    [call] = [item for item in response.output if item.type == "custom_tool_call"]
    assert (call.name, call.input) == ("apply_patch", PATCH)
    assert call.call_id.startswith("call_")


def test_responses_streams_the_input_as_deltas(family_server: tuple[str, RunningServer]) -> None:
    _, server = family_server
    events = list(
        client(server).responses.create(
            model="local", input="Write hello.txt.", tools=[APPLY_PATCH], stream=True
        )
    )
    deltas = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
    [done] = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert len(deltas) > 1, "the input streams as the model writes it"
    assert "".join(deltas) == done.input == PATCH
    [added] = [e.item for e in events if e.type == "response.output_item.added"]
    assert (added.type, expect(ResponseCustomToolCall, added).input) == ("custom_tool_call", "")
    completed = expect(ResponseCompletedEvent, events[-1]).response
    assert expect(ResponseCustomToolCall, completed.output[-1]).input == PATCH


def test_chat_completions_answers_a_custom_call_streamed_and_not(
    family_server: tuple[str, RunningServer],
) -> None:
    _, server = family_server
    tool = nested_chat_tool(APPLY_PATCH)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Write hello.txt."}]
    sdk = client(server)
    reply = sdk.chat.completions.create(model="local", messages=messages, tools=[tool])
    [call] = reply.choices[0].message.tool_calls or []
    assert call.type == "custom"
    assert (call.custom.name, call.custom.input) == ("apply_patch", PATCH)
    assert reply.choices[0].finish_reason == "tool_calls"

    chunks = list(
        sdk.chat.completions.create(model="local", messages=messages, tools=[tool], stream=True)
    )
    calls = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices[0].delta.tool_calls]
    first: Any = calls[0]
    assert (first.type, first.custom["name"]) == ("custom", "apply_patch")
    assert "".join(c.custom["input"] for c in calls) == PATCH  # type: ignore[attr-defined]


def test_a_call_and_its_output_replay_into_the_next_turn(
    family_server: tuple[str, RunningServer],
) -> None:
    _, server = family_server
    sdk = client(server)
    first = sdk.responses.create(model="local", input="Write hello.txt.", tools=[APPLY_PATCH])
    [call] = [item for item in first.output if item.type == "custom_tool_call"]
    output: ResponseCustomToolCallOutputParam = {
        "type": "custom_tool_call_output",
        "call_id": call.call_id,
        "output": "Done!",
    }
    second = sdk.responses.create(
        model="local",
        input=[
            {"role": "user", "content": "Write hello.txt."},
            replayed(call),
            output,
        ],
        tools=[APPLY_PATCH],
    )
    assert second.output_text == ANSWER
    assert second.usage is not None
    assert second.usage.input_tokens_details.cached_tokens > 0, "turn 1's prompt is reused"
    # The same conversation through Chat Completions, with OpenAI's custom call shape.
    tool = chat_tool({k: v for k, v in APPLY_PATCH.items() if k != "type"})
    reply = sdk.chat.completions.create(
        model="local",
        messages=[
            {"role": "user", "content": "Write hello.txt."},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "custom",
                        "custom": {"name": "apply_patch", "input": PATCH},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "Done!"},
        ],
        tools=[tool],
    )
    assert reply.choices[0].message.content == ANSWER


def test_the_grammar_holds_a_forced_call(family_server: tuple[str, RunningServer]) -> None:
    """The script writes `purple`: held to a grammar of three colours (tool_choice naming the
    tool), the input is one of them, written raw (Qwen3-Coder's XML) or inside a JSON string
    (Hermes); free text keeps `purple`."""
    _, server = family_server
    sdk = client(server)

    def painted(tool: CustomToolParam) -> str:
        response = sdk.responses.create(
            model="local",
            input="Paint the wall.",
            tools=[tool],
            tool_choice={"type": "custom", "name": "paint"},
            max_output_tokens=64,
        )
        [call] = [item for item in response.output if item.type == "custom_tool_call"]
        return call.input

    assert painted(PAINT) == "purple"
    colours: CustomToolParam = {
        **PAINT,
        "format": {"type": "grammar", "syntax": "lark", "definition": COLOURS},
    }
    assert painted(colours) in ("red", "green", "blue")
    regex: CustomToolParam = {
        **PAINT,
        "format": {"type": "grammar", "syntax": "regex", "definition": "gr[ae]y"},
    }
    assert painted(regex) in ("gray", "grey")


@pytest.mark.parametrize("api", ["responses", "chat", "chat-flat"])
def test_a_grammar_that_does_not_compile_is_a_400_naming_the_tool(
    family_server: tuple[str, RunningServer], api: str
) -> None:
    _, server = family_server
    bad: Grammar = {"type": "grammar", "syntax": "lark", "definition": "start: undefined_rule"}
    sdk = client(server)
    with pytest.raises(openai.BadRequestError) as caught:
        if api == "responses":
            sdk.responses.create(model="local", input="hi", tools=[{**PAINT, "format": bad}])
        else:
            tool = (
                nested_chat_tool({**PAINT, "format": bad})
                if api == "chat"
                else chat_tool({"name": "paint", "format": bad})
            )
            sdk.chat.completions.create(
                model="local", messages=[{"role": "user", "content": "hi"}], tools=[tool]
            )
    assert caught.value.status_code == 400
    message = caught.value.body["message"]  # type: ignore[index]
    assert "custom tool 'paint'" in message and "cannot be compiled" in message, message


@pytest.mark.parametrize(
    ("grammar", "sentences", "not_sentences"),
    [
        (
            APPLY_PATCH_GRAMMAR,
            [
                PATCH,
                "*** Begin Patch\n*** Update File: x.py\n@@ def f():\n-    print('hi')\n"
                '+    print("héllo 😀\\t")\n*** End Patch\n',
            ],
            ["*** Begin Patch\n*** End Patch", "*** Begin Patch\n*** Add File: a\n+x\n\n"],
        ),
        (COLOURS, ["red", "blue"], ["purple", "re"]),
        ('start: /gr[ae]y/ ";"', ["gray;", "grey;"], ["griy;"]),
        (r'start: /[^a-c"]+/', ["xyz?", "de f\n"], ["abc", 'de"f']),
        ("start: /\\d{2,3}/ WS /x|y/\n%import common.WS", ["12 x", "123\n\ty"], ["1 x"]),
    ],
)
def test_a_grammar_holds_its_sentences_written_in_a_json_string(
    grammar: str, sentences: list[str], not_sentences: list[str]
) -> None:
    """The escaped grammar takes each sentence as JSON writes it (quotes, backslashes, newlines
    and tabs escaped, other characters as they are) and nothing else."""
    held = escaped(grammar)
    assert held is not None
    chat = tokenizer("qwen3")
    vocab = llguidance.LLTokenizer(chat.tokenizer.to_str(), n_vocab=151936, eos_token=[0])
    compiled = llguidance.LLMatcher.grammar_from_lark(held)
    assert not llguidance.LLMatcher.validate_grammar(compiled)
    for sentence, expected in [(s, True) for s in sentences] + [(s, False) for s in not_sentences]:
        written = json.dumps(sentence, ensure_ascii=False)[1:-1]
        ids = chat.tokenizer.encode(written, add_special_tokens=False).ids
        matcher = llguidance.LLMatcher(vocab, compiled)
        taken = matcher.try_consume_tokens(ids)
        assert (taken == len(ids) and matcher.is_accepting()) == expected, (sentence, written)


def test_a_grammar_with_no_exact_escaping_is_not_held_in_json() -> None:
    """Anchors, lookarounds and skipped terminals have no JSON-escaped counterpart: the input is
    then a JSON string."""
    assert escaped("start: /^a/") is None
    assert escaped("start: /a(?=b)/") is None
    assert escaped('start: "a" "b"\n%ignore " "') is None
