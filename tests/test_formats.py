"""Each model family's prompt side against its chat template: detection, a Claude Code-shaped
conversation rendered exactly as the template renders it when fed natively, forced calls, and
prefix reuse from one turn to the next (turn 1's prompt plus the reply the model writes must
open turn 2's prompt, or the prefix cache misses every turn).

The templates are the families' published chat templates (tests/fixtures/templates/*.jinja, each
naming its source in its first line)."""

# ruff: noqa: RUF001 (DeepSeek's tags are written with fullwidth bars)

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from mlxgate import formats, prompts
from mlxgate.api.anthropic.requests import MessagesRequest
from mlxgate.api.anthropic.requests import conversation as anthropic_conversation
from mlxgate.engine.constraints import Grammar, Vocabulary
from mlxgate.formats import deepseek_v3, hermes
from mlxgate.models.tokenizer import ChatTokenizer

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"

SYSTEM = "You are Claude Code, an interactive CLI tool. Be concise."
REASONING = "The user wants the files listed; Bash with ls does it."
TEXT = "I'll list the files."
COMMAND = {"command": "ls -la", "description": "List files"}
RESULT = "total 8\n-rw-r--r-- 1 u u 12 a.txt <b>"
FOLLOW_UP = "Now count them."


@dataclass(frozen=True)
class Family:
    template: str  # file name under TEMPLATES
    tool_format: str
    reasoning: str
    # What the model writes after turn 1's prompt: reasoning, text, the call as the format
    # writes it (`call`), its end token.
    reply: Callable[[str], str]
    bos: str = ""
    eos: str = ""
    # The conversation in the template's own message shape (the neutral one unless changed).
    native: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] = lambda m: m
    # Turn 2 reuses turn 1's prompt and reply whole; otherwise the share asserted (>= 90%).
    exact_prefix: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def _harmony_native(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            # gpt-oss: the analysis in `thinking`, no text beside a call (the template refuses it).
            m = {"role": "assistant", "content": "", "thinking": m["reasoning_content"]} | {
                "tool_calls": m["tool_calls"]
            }
        out.append(m)
    return out


def _mistral_native(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("reasoning_content"):
            blocks = [
                {"type": "thinking", "thinking": m["reasoning_content"]},
                {"type": "text", "text": m["content"]},
            ]
            m = {"role": "assistant", "content": blocks, "tool_calls": m["tool_calls"]}
        if m["role"] == "user" and out[-1]["role"] == "tool":
            # The template wants an answer between results and the next user turn: none here.
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{m['content']}"}
            continue
        out.append(m)
    return out


def _without_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]


def _deepseek_native(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """V3.1's template lists no tools: the system prompt does, as the model card shows."""
    system = f"{SYSTEM}\n\n{deepseek_v3.tool_prompt(native_tools())}"
    return [{"role": "system", "content": system}, *_without_reasoning(messages[1:])]


FAMILIES: dict[str, Family] = {
    "qwen3_coder": Family(
        "qwen3_coder.jinja",
        "qwen3_coder",
        "none",
        lambda call: f"{TEXT}\n\n{call}<|im_end|>",
        native=_without_reasoning,
    ),
    "qwen3_5": Family(
        "qwen3_5.jinja",
        "qwen3_coder",
        "think",
        lambda call: f"{REASONING}\n</think>\n\n{TEXT}\n\n{call}<|im_end|>",
    ),
    "gpt_oss": Family(
        "gpt_oss.jinja",
        "harmony",
        "harmony",
        lambda call: f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant{call}",
        native=_harmony_native,
        # The template writes a call's recipient before its channel (`assistant to=functions.X
        # <|channel|>commentary json`), the model after it (`<|channel|>commentary to=functions.X
        # <|constrain|>json`): the history from that call on is re-read.
        exact_prefix=False,
    ),
    "glm_4_6": Family(
        "glm_4_6.jinja",
        "glm",
        "think",
        lambda call: f"\n<think>{REASONING}</think>\n{TEXT}\n{call}<|observation|>",
    ),
    "ministral_3_reasoning": Family(
        "ministral_3_reasoning.jinja",
        "mistral_v11",
        "mistral",
        lambda call: f"[THINK]{REASONING}[/THINK]{TEXT}{call}</s>",
        bos="<s>",
        eos="</s>",
        native=_mistral_native,
    ),
    "kimi_k2_thinking": Family(
        "kimi_k2_thinking.jinja",
        "kimi_k2",
        "think",
        lambda call: f"<think>{REASONING}</think>{TEXT}{call}<|im_end|>",
    ),
    "deepseek_v3_1": Family(
        "deepseek_v3_1.jinja",
        "deepseek_v3",
        "think",
        # V3.1 calls tools without thinking; its template keeps no reasoning.
        lambda call: f"{TEXT}{call}<｜end▁of▁sentence｜>",
        bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>",
        native=_deepseek_native,
    ),
    "minimax_m2": Family(
        "minimax_m2.jinja",
        "minimax_m2",
        "think",
        lambda call: f"{REASONING}\n</think>\n\n{TEXT}\n{call}[e~[",
    ),
    "seed_oss": Family(
        "seed_oss.jinja",
        "seed_oss",
        "seed",
        lambda call: f"<seed:think>{REASONING}</seed:think>\n{TEXT}\n\n{call}<seed:eos>",
    ),
}


def claude_code_tools() -> list[dict[str, Any]]:
    """Twenty tools shaped like Claude Code's (names, descriptions, JSON schemas)."""
    names = [
        "Bash", "Read", "Write", "Edit", "MultiEdit", "Glob", "Grep", "LS", "Task", "TodoWrite",
        "WebFetch", "WebSearch", "NotebookEdit", "BashOutput", "KillShell", "ExitPlanMode",
        "SlashCommand", "AskUserQuestion", "Skill", "ListMcpResources",
    ]  # fmt: skip
    tools = []
    for name in names:
        properties: dict[str, Any] = {
            "command" if name == "Bash" else "path": {"type": "string", "description": "what"},
            "timeout": {"type": "number", "description": "milliseconds"},
        }
        if name == "Bash":
            properties["description"] = {"type": "string"}
        if name == "TodoWrite":
            properties["todos"] = {"type": "array", "items": {"type": "object"}}
        tools.append(
            {
                "name": name,
                "description": f"The {name} tool. Use it when {name.lower()} is needed.",
                "input_schema": {
                    "type": "object",
                    "properties": properties,
                    "required": [next(iter(properties))],
                    "additionalProperties": False,
                    "$schema": "http://json-schema.org/draft-07/schema#",
                },
            }
        )
    return tools


def tokenizer(family: Family) -> ChatTokenizer:
    """One token per byte: enough to render and count, no model files."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i + 1 for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab={"<eos>": 0, **vocab}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    template = (TEMPLATES / family.template).read_text()
    return ChatTokenizer(
        tok, template, "byte_level", frozenset({0}), bos_token=family.bos, eos_token=family.eos
    )


@pytest.fixture(params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> Family:
    return FAMILIES[request.param]


def renderer(family: Family) -> prompts.Renderer:
    return prompts.Renderer(tokenizer(family))


def request(*turns: dict[str, Any], **body: Any) -> prompts.Conversation:
    """An Anthropic request as Claude Code sends it: billing header, system, all tools."""
    payload = {
        "model": "m",
        "max_tokens": 100,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.0; cch=1;"},
            {"type": "text", "text": SYSTEM},
        ],
        "tools": claude_code_tools(),
        "messages": [{"role": "user", "content": "List the files here."}, *turns],
        **body,
    }
    return anthropic_conversation(MessagesRequest.model_validate(payload))


ASSISTANT_CALL = {
    "role": "assistant",
    "content": [
        {"type": "thinking", "thinking": REASONING, "signature": ""},
        {"type": "text", "text": TEXT},
        {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": COMMAND},
    ],
}
TOOL_RESULT = {
    "role": "user",
    "content": [
        {
            "type": "tool_result",
            "tool_use_id": "toolu_1",
            "content": [{"type": "text", "text": RESULT}],
        }
    ],
}


def native_conversation(family: Family, follow_up: bool) -> list[dict[str, Any]]:
    """The same conversation written by hand in the neutral Hugging Face shape, then the
    template's own (what a caller of the template is expected to pass)."""
    call = {
        "id": "toolu_1",
        "type": "function",
        "function": {"name": "Bash", "arguments": COMMAND},
    }
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "List the files here."},
        {
            "role": "assistant",
            "content": TEXT,
            "reasoning_content": REASONING,
            "tool_calls": [call],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": RESULT},
    ]
    if follow_up:
        messages.append({"role": "user", "content": FOLLOW_UP})
    return family.native(messages)


def native_tools() -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t["description"],
                "parameters": t["input_schema"],
            },
        }
        for t in claude_code_tools()
    ]


def test_every_fixture_is_detected(family: Family) -> None:
    fmt = prompts.ChatFormat.detect((TEMPLATES / family.template).read_text())
    assert (fmt.tool_format.NAME, fmt.reasoning.name) == (family.tool_format, family.reasoning)


@pytest.mark.parametrize("follow_up", [False, True], ids=["after_tool_result", "next_question"])
def test_a_claude_code_conversation_renders_as_the_template_renders_it(
    family: Family, follow_up: bool
) -> None:
    """mlxgate's rendering of the Anthropic request equals the template's own rendering of the
    same conversation in its native message shape."""
    turns: list[dict[str, Any]] = [ASSISTANT_CALL, TOOL_RESULT]
    if follow_up:
        turns.append({"role": "user", "content": FOLLOW_UP})
    r = renderer(family)
    prompt = r.render(request(*turns))
    tools = native_tools() if r.format.template_renders_tools else None
    expected = r.tokenizer.render(
        native_conversation(family, follow_up), tools=tools, add_generation_prompt=True
    )
    assert prompt.text == expected
    assert "billing-header" not in prompt.text
    assert SYSTEM in prompt.text and "ls -la" in prompt.text and "a.txt <b>" in prompt.text
    assert all(t["name"] in prompt.text for t in claude_code_tools())


def test_turn_two_reuses_turn_one(family: Family) -> None:
    """Turn 1's prompt plus the reply the model writes is where turn 2's prompt starts."""
    r = renderer(family)
    fmt = formats.TOOL_FORMATS[family.tool_format]
    first = r.render(request())
    reply = family.reply(fmt.render_call("Bash", COMMAND))
    second = r.render(request(ASSISTANT_CALL, TOOL_RESULT))
    generated = first.text + reply
    shared = next(
        (i for i, (a, b) in enumerate(zip(generated, second.text, strict=False)) if a != b),
        min(len(generated), len(second.text)),
    )
    share = shared / len(second.text)
    print(f"{family.template}: {shared}/{len(second.text)} chars ({share:.1%}) reused")
    if family.exact_prefix:
        assert second.text.startswith(generated), (generated[shared:], second.text[shared:])
    assert share >= 0.9


def test_forced_tool_choice_opens_the_call_as_the_format_writes_it(family: Family) -> None:
    r = renderer(family)
    fmt = r.format.tool_format
    for choice, opening in (
        ({"type": "tool", "name": "Bash"}, fmt.forced_opening("Bash")),
        ({"type": "any"}, fmt.forced_opening(None)),
    ):
        prompt = r.render(request(tool_choice=choice))
        assert prompt.text.endswith(opening) and prompt.reply.prefill.endswith(opening)
        assert prompt.ids == r.encode(prompt.text)
        if r.format.think is not None:  # the call is not made inside an open reasoning block
            assert not prompt.reply.prefill.startswith(r.format.think[0])
    none = r.render(request(tool_choice={"type": "none"}))
    assert "The Bash tool" not in none.text and none.reply.markup is r.format.markup_text


def test_a_named_call_starts_the_render_of_that_call(family: Family) -> None:
    fmt = formats.TOOL_FORMATS[family.tool_format]
    whole = fmt.render_call("Bash", COMMAND)
    assert whole.startswith(fmt.forced_opening("Bash"))
    assert whole.startswith(fmt.forced_opening(None))


def test_parallel_calls_and_error_results_render(family: Family) -> None:
    """Two calls in one turn, an error result and a block result reach the template whole."""
    turns: list[dict[str, Any]] = [
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "t1", "name": "Read", "input": {"path": "a"}},
                {"type": "tool_use", "id": "t2", "name": "Bash", "input": {"command": "wc"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "no such file",
                 "is_error": True},
                {"type": "tool_result", "tool_use_id": "t2", "content": [
                    {"type": "text", "text": "3"}]},
            ],
        },
    ]  # fmt: skip
    text = renderer(family).render(request(*turns)).text
    assert "Error: no such file" in text and "wc" in text and "{'path'" not in text
    assert text.index("Error: no such file") < text.rindex("3")


def test_overrides_name_the_formats() -> None:
    family = FAMILIES["qwen3_coder"]
    r = prompts.Renderer(tokenizer(family), tool_format="hermes", reasoning_format="think")
    assert (r.format.tool_format.NAME, r.format.reasoning.name) == ("hermes", "think")
    prompt = r.render(request(tool_choice={"type": "tool", "name": "Bash"}))
    assert prompt.text.endswith(hermes.forced_opening("Bash"))


def test_arguments_go_as_objects_or_as_json_text_as_the_template_reads_them() -> None:
    prints = "{% for m in messages %}{% for c in m.tool_calls or [] %}[{{ c.function.arguments }}]"
    prints += "{% endfor %}{% endfor %}{{ (tools or []) | length }}"
    r = prompts.Renderer(ChatTokenizer(tokenizer(FAMILIES["qwen3_coder"]).tokenizer, prints,
                                    "byte_level", frozenset({0})))  # fmt: skip
    assert r.arguments_as_json
    text = r.render(request(ASSISTANT_CALL, TOOL_RESULT)).text
    assert f"[{json.dumps(COMMAND)}]" in text
    assert not renderer(FAMILIES["qwen3_coder"]).arguments_as_json


def test_a_forced_calls_grammar_admits_exactly_the_calls_the_schema_allows(family: Family) -> None:
    """The rest of a forced call (after the opening the prompt ends with) must be a call of the
    tool with schema-valid arguments, closed as the format closes it."""
    r = renderer(family)
    fmt = r.format.tool_format
    vocabulary = Vocabulary(r.tokenizer.tokenizer, [0])
    width = r.tokenizer.vocab_size

    def admits(prompt: prompts.Prompt, call: str) -> bool:
        """Whether the grammar takes what follows the forced opening (without any reasoning the
        prefill holds before it)."""
        assert prompt.call_grammar is not None
        matcher = vocabulary.matcher(Grammar.lark(prompt.call_grammar), width)
        opening = fmt.forced_opening("Bash" if prompt is named else None)
        assert prompt.reply.prefill.endswith(opening)
        rest = call.removeprefix(opening)
        assert rest != call, "the call starts with the forced opening"
        return all(matcher.consume_token(t) for t in r.encode(rest)) and matcher.is_accepting()

    named = r.render(request(tool_choice={"type": "tool", "name": "Bash"}))
    anyone = r.render(request(tool_choice={"type": "any"}))
    opening = fmt.forced_opening("Bash")
    assert named.reply.prefill.endswith(opening)
    assert admits(named, fmt.render_call("Bash", COMMAND))
    assert admits(named, fmt.render_call("Bash", {"command": 'echo "a\nb" <x>', "timeout": 5}))
    assert not admits(named, fmt.render_call("Bash", {"description": "no command"}))
    assert not admits(named, fmt.render_call("Bash", {"command": "ls", "timeout": "soon"}))
    assert admits(anyone, fmt.render_call("Read", {"path": "a.txt"}))
    assert admits(anyone, fmt.render_call("Bash", COMMAND))
    assert not admits(anyone, fmt.render_call("Nope", {"path": "a.txt"}))


def test_strict_tools_hold_the_calls_the_model_chooses_to_make(family: Family) -> None:
    """`strict` tools with tool_choice auto: any text, and every call in it valid for its tool
    (not for harmony, whose call opening also opens its answer)."""
    r = renderer(family)
    fmt = r.format.tool_format
    conversation = replace(request(), strict_tools=True)
    prompt = r.render(conversation)
    if family.tool_format == "harmony":  # its `<|channel|>` opens answers too
        assert prompt.call_grammar is None
        return
    assert prompt.call_grammar is not None
    vocabulary = Vocabulary(r.tokenizer.tokenizer, [0])
    grammar = Grammar.lark(prompt.call_grammar)

    def admits(reply: str) -> bool:
        matcher = vocabulary.matcher(grammar, r.tokenizer.vocab_size)
        return all(matcher.consume_token(t) for t in r.encode(reply)) and matcher.is_accepting()

    good, bad = fmt.render_call("Bash", COMMAND), fmt.render_call("Bash", {"description": "x"})
    assert admits("No call needed: the answer is 4.")
    assert admits(f"{TEXT}\n{good}")
    assert admits(f"{good}\n{fmt.render_call('Read', {'path': 'a.txt'})}")
    assert not admits(f"{TEXT}\n{bad}")
    assert r.render(replace(request(), strict_tools=False)).call_grammar is None


def test_a_structured_reply_opens_the_answer_without_reasoning(family: Family) -> None:
    """Structured output: thinking is off (an opened think tag is closed); harmony's reply starts
    in its final channel, which the prompt opens (and the parser reads as already open)."""
    r = renderer(family)
    prompt = r.render(replace(request(), structured=True))
    if family.tool_format == "harmony":
        opening = r.format.reasoning.answer
        assert prompt.text.endswith(opening) and prompt.reply.prefill == opening
    elif r.format.think is not None:
        assert not prompt.reply.prefill.startswith(r.format.think[0])
