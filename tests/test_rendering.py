"""Request conversion and prompt rendering without a model: each dialect's request becomes the
same conversation, the conversation the same prompt, and each format's prompt side agrees with
the Rust parser of the same name."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from mlxgate import formats, prompts
from mlxgate._native import FinishReason, Markup, Reply, Router, StreamSpec, Vocab
from mlxgate.api.anthropic.requests import MessagesRequest
from mlxgate.api.anthropic.requests import conversation as anthropic_conversation
from mlxgate.api.errors import ApiError
from mlxgate.api.openai.requests import ChatCompletionRequest
from mlxgate.api.openai.requests import conversation as openai_conversation
from mlxgate.models.tokenizer import DEFAULT_CHATML_TEMPLATE, ChatTokenizer, VocabKind

# A ChatML template that renders tools itself, Qwen 2.5 style (trimmed to what matters here).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] }}\n\n{% endif %}# Tools\n<tools>{% for t in tools %}\n"
    "{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' and tools %}{% elif m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}"
    '\n<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BASH = {
    "name": "Bash",
    "description": "Run a command",
    "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
}


def byte_tokenizer(template: str) -> ChatTokenizer:
    """A byte-level tokenizer (one token per byte) with `template`: enough to render and count."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<|im_end|>": 0, **{ch: i + 1 for i, ch in enumerate(sorted(alphabet))}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return ChatTokenizer(tokenizer, template, "byte_level", frozenset({0}), eos_token="<|im_end|>")


@pytest.fixture(params=["inline", "template"])
def renderer(request: pytest.FixtureRequest) -> prompts.Renderer:
    template = DEFAULT_CHATML_TEMPLATE if request.param == "inline" else TOOLS_TEMPLATE
    return prompts.Renderer(byte_tokenizer(template))


def anthropic(**body: Any) -> prompts.Conversation:
    return anthropic_conversation(MessagesRequest.model_validate({"model": "m", **body}))


def openai(**body: Any) -> prompts.Conversation:
    return openai_conversation(ChatCompletionRequest.model_validate({"model": "m", **body}))


def test_a_tool_round_trip_is_the_same_conversation_in_both_dialects(
    renderer: prompts.Renderer,
) -> None:
    args = {"command": "ls"}
    from_anthropic = anthropic(
        max_tokens=10,
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1;"},
            {"type": "text", "text": "Be brief."},
        ],
        tools=[BASH, {**BASH, "name": "Deferred", "defer_loading": True}],
        messages=[
            {"role": "user", "content": "list files"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": ""},
                    {"type": "tool_use", "id": "t1", "name": "Bash", "input": args},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.txt"}],
            },
        ],
    )
    from_openai = openai(
        tools=[{"type": "function", "function": {**BASH, "parameters": BASH["input_schema"]}}],
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "list files"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "hmm",
                "tool_calls": [
                    {
                        "id": "t1",
                        "type": "function",
                        "function": {"name": "Bash", "arguments": json.dumps(args)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "t1", "content": "a.txt"},
        ],
    )
    assert [t["function"]["name"] for t in from_anthropic.tools] == ["Bash"], "deferred skipped"
    assert from_anthropic.messages == from_openai.messages
    prompt = renderer.render(from_anthropic)
    assert prompt == renderer.render(from_openai)
    assert "billing-header" not in prompt.text and "Be brief." in prompt.text
    assert '"arguments": {"command": "ls"}' in prompt.text
    assert "<tool_response>\na.txt\n</tool_response>" in prompt.text
    assert prompt.ids == renderer.encode(prompt.text)
    assert prompt.reply.markup is renderer.format.markup_tools


def test_system_messages_later_in_the_conversation_stay_where_they_are(
    renderer: prompts.Renderer,
) -> None:
    """Claude Code's system messages (string, blocks, empty) after the first user turn: a
    system turn in place where the template renders one there (ChatML), else user text in
    `<system-reminder>` tags (the tools template drops system turns); never moved into the
    first system message, so each turn's prompt is the start of the next one's."""
    turns: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": [{"type": "text", "text": "reminder"}]},
        {"role": "system", "content": []},
    ]
    first = renderer.render(anthropic(max_tokens=10, system="Be brief.", messages=turns))
    assert renderer.system_anywhere is (renderer.format.template_renders_tools is False)
    if renderer.system_anywhere:
        chatml = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>system\nreminder<|im_end|>\n"
        assert chatml in first.text
    else:
        assert first.text.count("<|im_start|>user\n") == 1
        assert "hi\n\n<system-reminder>\nreminder\n</system-reminder>" in first.text
    assert first.text.index("Be brief.") < first.text.index("hi") < first.text.index("reminder")
    later = [
        *turns,
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Thanks."},
        {"role": "system", "content": "another reminder"},
    ]
    second = renderer.render(anthropic(max_tokens=10, system="Be brief.", messages=later))
    assert second.text.startswith(first.text)
    same = anthropic(
        max_tokens=10,
        system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": "hi"}],
    )
    assert (
        renderer.render(same).text
        == renderer.render(
            anthropic(
                max_tokens=10, system="Be brief.", messages=[{"role": "user", "content": "hi"}]
            )
        ).text
    )


def test_forced_tool_choice_starts_the_call_in_the_prompt(renderer: prompts.Renderer) -> None:
    for choice, opening in (
        ({"type": "tool", "name": "Bash"}, '<tool_call>\n{"name": "Bash", "arguments": '),
        ({"type": "any"}, '<tool_call>\n{"name": "'),
    ):
        prompt = renderer.render(
            anthropic(
                max_tokens=10,
                tools=[BASH],
                tool_choice=choice,
                messages=[{"role": "user", "content": "go"}],
            )
        )
        assert prompt.text.endswith(opening) and prompt.reply.prefill.endswith(opening)
    none = renderer.render(
        anthropic(
            max_tokens=10,
            tools=[BASH],
            tool_choice={"type": "none"},
            messages=[{"role": "user", "content": "go"}],
        )
    )
    assert "Bash" not in none.text and none.reply.markup is renderer.format.markup_text


def test_conversations_that_cannot_render_are_400s(renderer: prompts.Renderer) -> None:
    with pytest.raises(prompts.ConversationError, match="not in tools"):
        renderer.render(
            anthropic(
                max_tokens=1,
                tools=[BASH],
                tool_choice={"type": "tool", "name": "Read"},
                messages=[{"role": "user", "content": "go"}],
            )
        )
    with pytest.raises(prompts.ConversationError, match="at least one user message"):
        renderer.render(anthropic(max_tokens=1, messages=[{"role": "assistant", "content": "x"}]))
    document = {"type": "document", "source": {"type": "base64", "data": ""}}
    with pytest.raises(ApiError, match="document input is not supported"):
        anthropic(max_tokens=1, messages=[{"role": "user", "content": [document]}])
    bad_call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{"}}
    with pytest.raises(ApiError, match="not valid JSON"):
        openai(messages=[{"role": "assistant", "content": "", "tool_calls": [bad_call]}])


def test_a_trailing_assistant_turn_is_continued() -> None:
    renderer = prompts.Renderer(byte_tokenizer(DEFAULT_CHATML_TEMPLATE))
    prompt = renderer.render(
        openai(
            messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
        )
    )
    assert prompt.text.endswith("<|im_start|>assistant\nSure")


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{ '[TOOL_CALLS]' }}", "mistral"),
        ("{% if ipython %}<|python_tag|>{% endif %}", "llama3_json"),
        ("<tool_call>{{ tools }}", "hermes"),
        ("{{ messages }}", "hermes"),
    ],
)
def test_tool_format_detection(template: str, expected: str) -> None:
    assert expected == formats.detect_tool_format(template).NAME
    markup = prompts.ChatFormat.detect(template).markup_tools
    assert markup is not None
    assert markup.tool_call == expected


BASH_SCHEMA = {
    "type": "object",
    "properties": {"command": {"type": "string"}, "n": {"type": "array"}},
}


@pytest.mark.parametrize("name", list(formats.TOOL_FORMATS))
def test_each_format_teaches_its_own_calls_and_results(name: str) -> None:
    """A template that does not list tools gets them listed with a call written in the format's
    own markup (which the Rust parser of that name reads back), never another format's tags."""
    fmt = formats.TOOL_FORMATS[name]
    prompt = formats.tool_prompt(fmt, [{"type": "function", "function": {"name": "Bash"}}])
    assert "Bash" in prompt
    if name not in ("hermes", "deepseek_v3"):  # these two teach calls in their models' own words
        example = prompt[prompt.rindex("example:\n") + len("example:\n") :]
        calls = _parse(Markup(tool_call=name), "", example)
        assert calls == [("function_name", {"argument": "value"})], example
        uses_tool_call_tag = "<tool_call>" in fmt.render_call("f", {})
        assert ("<tool_call>" in prompt) == uses_tool_call_tag
    assert "a.txt" in fmt.tool_result("a.txt")


@pytest.mark.parametrize("name", list(formats.TOOL_FORMATS))
def test_each_formats_prompt_side_parses_back_in_rust(name: str) -> None:
    """An earlier call as the format renders it, and a forced call's opening plus the model's
    rest, both come back from the Rust parser of the same name as the same tool call."""
    fmt = formats.TOOL_FORMATS[name]
    args = {"command": "echo 'héllo' > <f>", "n": [1, {"k": None}]}
    whole = fmt.render_call("Bash", args)
    opening = fmt.forced_opening("Bash")
    assert whole.startswith(opening)
    for prefill, text in (("", whole), (opening, whole[len(opening) :])):
        calls = _parse(Markup(tool_call=name), prefill, text)
        assert calls == [("Bash", args)], (prefill, text)


def _parse(markup: Markup, prefill: str, text: str) -> list[tuple[str, Any]]:
    """The tool calls of a non-streamed OpenAI body for `text`, fed one character per token."""
    chars = sorted(set(text))
    vocab = Vocab.from_token_bytes([b"<eos>", *(c.encode() for c in chars)], [0])
    router = Router(vocab)
    spec = StreamSpec.openai(
        model="m",
        completion_id="c",
        created=0,
        stream=False,
        reply=Reply(
            markup=markup, prefill=prefill, eos_ids=[0], tools=[("Bash", json.dumps(BASH_SCHEMA))]
        ),
    )
    reader = router.open(1, spec, prompt_tokens=1, max_tokens=10_000)
    ended = router.step([1] * len(text), [chars.index(c) + 1 for c in text])
    ended += router.step([1], [0])
    assert ended == [(1, FinishReason.TOOL_USE)]
    message = json.loads(reader.take() or b"")["choices"][0]["message"]
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ]


def test_the_templates_turn_end_token_ends_a_reply() -> None:
    """A model ends its reply with the token its template closes assistant turns with, even
    where the tokenizer's `eos_token` is another (Llama 3's `<|eot_id|>` beside
    `<|end_of_text|>`)."""
    from tokenizers import AddedToken

    template = (
        "{% for m in messages %}<|start|>{{ m.role }}\n{{ m.content }}<|eot|>{% endfor %}"
        "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
    )
    tokenizer = byte_tokenizer(template)
    tokenizer.tokenizer.add_special_tokens([AddedToken("<|eot|>", special=True)])
    eot = tokenizer.tokenizer.token_to_id("<|eot|>")
    assert eot is not None
    tokenizer = dataclasses.replace(tokenizer, special_ids=frozenset({0, eot}))
    assert prompts.Renderer(tokenizer).eos_ids == [0, eot]
    # A template that closes turns with plain text adds nothing.
    assert prompts.Renderer(byte_tokenizer(template.replace("<|eot|>", "\n"))).eos_ids == [0]


@pytest.mark.parametrize(
    ("thinking", "effort", "message_effort", "expected"),
    [
        (None, None, None, None),
        ({"type": "adaptive", "display": "omitted"}, "high", None, None),
        ({"type": "enabled", "budget_tokens": 31999, "display": "omitted"}, None, None, True),
        ({"type": "disabled"}, "max", None, False),
        ({"type": "adaptive"}, "low", None, False),
        ({"type": "enabled", "budget_tokens": 1024}, "low", None, True),
        ({"type": "adaptive"}, None, "low", False),
        ({"type": "adaptive"}, "medium", "low", None),
    ],
)
def test_thinking_is_as_asked_and_low_effort_turns_it_off(
    thinking: dict[str, Any] | None,
    effort: str | None,
    message_effort: str | None,
    expected: bool | None,
) -> None:
    """Claude Code's fields: `thinking` adaptive (the template's default), enabled or disabled;
    `output_config.effort`, also on its system messages; `context_management` (accepted)."""
    system: dict[str, Any] = {"role": "system", "content": "# Environment"}
    if message_effort:
        system["output_config"] = {"effort": message_effort}
    body: dict[str, Any] = {
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "hi"}, system],
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    }
    if thinking:
        body["thinking"] = thinking
    if effort:
        body["output_config"] = {"effort": effort}
    assert anthropic(**body).thinking is expected


@pytest.mark.parametrize(
    ("kind", "steps", "trims"),
    [
        # Llama 2's and Mistral's decoder: the reply's first space is dropped.
        (
            "sentencepiece",
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ],
            True,
        ),
        # Gemma's: kept.
        (
            "sentencepiece",
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()],
            False,
        ),
        ("byte_level", [decoders.ByteLevel()], False),
    ],
)
def test_a_reply_reads_as_the_tokenizer_decodes_it(
    kind: VocabKind, steps: list[Any], trims: bool
) -> None:
    """The native vocabulary trims a leading space exactly where the model's decoder does."""
    words = ["▁Hello", "▁world", "<0x21>"] if kind == "sentencepiece" else ["ĠHello", "Ġworld", "!"]
    tokenizer = Tokenizer(
        models.BPE({w: i for i, w in enumerate(words)}, [], byte_fallback=kind == "sentencepiece")
    )
    tokenizer.decoder = decoders.Sequence(steps)
    chat_tokenizer = ChatTokenizer(tokenizer, DEFAULT_CHATML_TEMPLATE, kind, frozenset())
    assert chat_tokenizer.trims_leading_space is trims
    assert chat_tokenizer.native_vocab().decode([0, 1, 2]) == tokenizer.decode([0, 1, 2])
