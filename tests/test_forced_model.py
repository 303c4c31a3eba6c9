"""The forced-output model on real vocabularies, served by the real server: the official SDKs get
tool calls a scripted model writes, Claude Code runs one and answers its result, and a Claude
Code-shaped conversation reuses its prompt from turn to turn, for every family."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import mlx.core as mx
import openai
import pytest
from anthropic.types import MessageParam, TextBlockParam, ToolParam
from mlx_lm.generate import generate_step
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from mlxgate import prompts
from mlxgate.api.anthropic.requests import MessagesRequest, conversation
from mlxgate.models import load
from support.agents import run_claude_code
from support.forced import (
    FAMILIES,
    LEAD_IN,
    THOUGHT,
    TOOL_RESULT,
    Script,
    answer,
    bash_call,
    call_markup,
    encode,
    forced_model_dir,
    serve_args,
    tokenizer,
)
from support.sdk import functions
from support.servers import RunningServer, start_server, stop_server

BASH: ToolParam = {
    "name": "Bash",
    "description": "Run a shell command",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
        "required": ["command"],
    },
}
OPENAI_BASH: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "Bash",
        "description": "Run a shell command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
            "required": ["command"],
        },
    },
}
HERMES_CALL = '<tool_call>\n{"name": "Bash", "arguments": {"command": "echo hi"}}\n</tool_call>'
# DeepSeek's tags are written with the fullwidth bar.
DEEPSEEK_CALL_START = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>Bash<｜tool▁sep｜>"  # noqa: RUF001
DEEPSEEK_END = "<｜end▁of▁sentence｜>"  # noqa: RUF001
# A trigger is best the start of a user message: it then encodes as it does inside the prompt.
QWEN3_SCRIPTS = [
    # Token 0 ("!") is in no prompt here, but it is what a batch's padding columns hold: a row
    # whose history took in padding would answer this.
    Script("Padding leaked!", when=[0]),
    Script("The command printed hi.", when="<tool_response>"),
    Script(HERMES_CALL, when="Run the tool"),
    Script("Apples are red, apples are sweet, apples are red.", when="apple"),
    Script("Bananas are yellow.", when="banana"),
    Script("Hello from a forced model."),
]


def generate(model_dir: Path, messages: list[dict[str, Any]], max_tokens: int = 80) -> str:
    """Greedy text from mlx-lm's own generation loop (no mlxgate engine)."""
    loaded = load(str(model_dir), trust_remote_code=True)
    chat_tokenizer = loaded.tokenizer
    out: list[int] = []
    prompt = mx.array(chat_tokenizer.encode(chat_tokenizer.render(messages)))
    for token, _ in generate_step(prompt, loaded.model, max_tokens=max_tokens):
        out.append(int(token))
        if out[-1] in chat_tokenizer.eos_ids:
            break
    return str(chat_tokenizer.tokenizer.decode(out, skip_special_tokens=False))


def test_mlx_lm_generates_the_script_picked_by_the_conversation(tmp_path: Path) -> None:
    model = forced_model_dir(tmp_path, "qwen3", QWEN3_SCRIPTS)
    assert generate(model, [{"role": "user", "content": "Run the tool now"}]) == (
        HERMES_CALL + "<|im_end|>"
    )
    assert generate(model, [{"role": "user", "content": "apple or pear?"}]) == (
        "Apples are red, apples are sweet, apples are red.<|im_end|>"
    )
    after_tool: list[dict[str, Any]] = [
        {"role": "user", "content": "Run the tool now"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "Bash", "arguments": {"command": "echo hi"}}}],
        },
        {"role": "tool", "content": "hi"},
    ]
    assert generate(model, after_tool) == "The command printed hi.<|im_end|>"
    assert generate(model, [{"role": "user", "content": "hi"}]) == (
        "Hello from a forced model.<|im_end|>"
    )


@pytest.mark.parametrize("banded", [False, True])
def test_rows_of_a_padded_batch_each_follow_their_own_history(tmp_path: Path, banded: bool) -> None:
    """Decoding rows of different lengths together, in one left-padded BatchKVCache or in bands
    of rows (mlxgate's BandedCache), each row's next token is the one its own tokens give."""
    from mlx_lm.models.cache import BatchKVCache

    from mlxgate.engine.banded_cache import BandedCache

    model_dir = forced_model_dir(tmp_path, "qwen3", QWEN3_SCRIPTS)
    model = load(str(model_dir), trust_remote_code=True).model
    chat_tokenizer = tokenizer("qwen3")
    prompts = [
        chat_tokenizer.encode(chat_tokenizer.render([{"role": "user", "content": text}]))
        for text in ("apple", "banana split " * 20, "Run the tool", "hi")
    ]
    rows = []
    for prompt in prompts:
        caches = model.make_cache()
        model.model(mx.array(prompt[:-1])[None], cache=caches)
        rows.append(caches[0])
    if banded:
        bands = [[BatchKVCache.merge(rows[:2])], [BatchKVCache.merge(rows[2:])]]  # type: ignore[no-untyped-call]
        cache: list[Any] = BandedCache.per_layer(bands)
    else:
        cache = [BatchKVCache.merge(rows)]  # type: ignore[no-untyped-call]
    logits = model(mx.array([[p[-1]] for p in prompts]), cache=cache)
    expected = [model.next_token(p) for p in prompts]
    assert mx.argmax(logits[:, -1], axis=-1).tolist() == expected
    assert chat_tokenizer.decode(expected) == chat_tokenizer.decode(
        [encode("qwen3", text)[0] for text in ("Apples", "Bananas", "<tool_call>", "Hello")]
    )


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gpt-oss"])
def test_bash_call_is_what_the_template_renders_for_a_call(family: str) -> None:
    """The call `bash_call` scripts (its reasoning included, where the template keeps it), and
    the tool-result trigger, are the family's own."""
    renderer = prompts.Renderer(tokenizer(family))
    command = 'echo "a <b>" > out.txt'
    messages: list[MessageParam] = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": THOUGHT, "signature": ""},
                {"type": "tool_use", "id": "call_1", "name": "Bash",
                 "input": {"command": command, "timeout": 5000}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                      "content": "done"}]},
    ]  # fmt: skip

    def render(messages: list[MessageParam]) -> str:
        body = {"model": "m", "max_tokens": 9, "messages": messages, "tools": [BASH]}
        return renderer.render(conversation(MessagesRequest.model_validate(body))).text

    rendered = render(messages)
    if family in LEAD_IN:
        assert bash_call(family, command, timeout=5000) in rendered
    assert call_markup(family, "Bash", {"command": command, "timeout": 5000}) in rendered
    result = encode(family, TOOL_RESULT[family])
    prompt = encode(family, rendered)
    assert any(prompt[i : i + len(result)] == result for i in range(len(prompt)))
    first_turn = encode(family, render(messages[:1]))
    assert not any(first_turn[i : i + len(result)] == result for i in range(len(first_turn)))


def test_vocabularies_are_the_families_own() -> None:
    qwen3 = tokenizer("qwen3")
    assert encode("qwen3", "<tool_call><think></think><|im_end|>") == [
        151657,
        151667,
        151668,
        151645,
    ]
    assert qwen3.encode("Hello world") == [9707, 1879]
    assert qwen3.eos_ids == {151645, 151643}
    harmony = tokenizer("gpt-oss")
    assert harmony.encode("<|start|>assistant<|channel|>final<|message|>Hi<|return|>") == [
        200006,
        173781,
        200005,
        17196,
        200008,
        12194,
        200002,
    ]
    assert harmony.eos_ids == {200002, 199999, 200012}
    assert harmony.vocab_size == 201088
    deepseek = tokenizer("deepseek-v3.1")
    calls = deepseek.encode(DEEPSEEK_CALL_START)
    assert calls[:2] == [128806, 128808]
    assert calls[-1] == 128814
    assert deepseek.encode(f"<think></think>{DEEPSEEK_END}") == [128798, 128799, 1]
    assert deepseek.eos_ids == {1}


@pytest.mark.parametrize(
    ("family", "script", "end"),
    [
        ("qwen3-coder", "Plain words.", "<|im_end|>"),
        ("gpt-oss", "<|channel|>final<|message|>Plain words.<|return|>", "<|return|>"),
        ("deepseek-v3.1", "Plain words.", DEEPSEEK_END),
    ],
)
def test_each_family_renders_and_writes_its_script(
    tmp_path: Path, family: str, script: str, end: str
) -> None:
    model = forced_model_dir(tmp_path, family, script=script)
    text = generate(model, [{"role": "user", "content": "hi"}])
    assert text == (script if script.endswith(end) else script + end)


def vocab_cases(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's tokenizer test texts and the ids the model's Hugging Face tokenizer gave."""
    folder = Path(__file__).parent / "fixtures" / "tokenizers" / "qwen3"
    texts = (folder / f"{name}.inp").read_text().split("\n__ggml_vocab_test__\n")
    ids = (folder / f"{name}.out").read_text().split("\n")
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, ids, strict=False)]


def test_qwen3_vocabulary_encodes_as_the_reference_tokenizer() -> None:
    chat_tokenizer = tokenizer("qwen3")
    cases = vocab_cases("ggml-vocab-qwen2.gguf")
    assert len(cases) > 40
    for text, ids in cases:
        assert chat_tokenizer.encode(text) == ids, text


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("forced-qwen3")
    model = forced_model_dir(tmp, "qwen3", QWEN3_SCRIPTS)
    # Small prefill chunks: long prompts are prefilled in several passes beside decoding rows.
    running = start_server(tmp, *serve_args(model), "--max-prefill-chunk", "64")
    yield running
    stop_server(running)


def anthropic_client(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="sk-local", max_retries=0)


def openai_client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-local", max_retries=0)


RUN: list[MessageParam] = [{"role": "user", "content": "Run the tool: say hi"}]
OPENAI_RUN: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Run the tool: say hi"}]


def test_anthropic_sdk_gets_the_tool_use(qwen3_server: RunningServer) -> None:
    message = anthropic_client(qwen3_server).messages.create(
        model="forced",
        max_tokens=200,
        messages=RUN,
        tools=[BASH],
    )
    assert message.stop_reason == "tool_use"
    calls = [block for block in message.content if block.type == "tool_use"]
    assert [(c.name, c.input) for c in calls] == [("Bash", {"command": "echo hi"})]
    assert not [b for b in message.content if b.type == "text" and "tool_call" in b.text]


def test_anthropic_sdk_streams_the_tool_use(qwen3_server: RunningServer) -> None:
    with anthropic_client(qwen3_server).messages.stream(
        model="forced",
        max_tokens=200,
        messages=RUN,
        tools=[BASH],
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    calls = [block for block in final.content if block.type == "tool_use"]
    assert [(c.name, c.input) for c in calls] == [("Bash", {"command": "echo hi"})]
    fragments = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert json.loads("".join(fragments)) == {"command": "echo hi"}


def test_openai_sdk_gets_the_tool_calls(qwen3_server: RunningServer) -> None:
    completion = openai_client(qwen3_server).chat.completions.create(
        model="forced",
        max_tokens=200,
        messages=OPENAI_RUN,
        tools=[OPENAI_BASH],
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [  # type: ignore[union-attr]
        ("Bash", {"command": "echo hi"})
    ]
    assert "tool_call" not in (choice.message.content or "")


def test_strict_tools_hold_the_call_the_model_chooses_to_its_schema(
    qwen3_server: RunningServer,
) -> None:
    """tool_choice auto with a `strict` tool: a valid call passes unchanged; a call the schema
    forbids (the script writes `echo hi`, the schema allows only `ls`) is held to the schema."""

    def called(parameters: dict[str, Any]) -> list[tuple[str, Any]]:
        tool: Any = {"type": "function", "function": {**OPENAI_BASH["function"], "strict": True}}
        tool["function"]["parameters"] = parameters
        completion = openai_client(qwen3_server).chat.completions.create(
            model="forced", max_tokens=200, messages=OPENAI_RUN, tools=[tool]
        )
        choice = completion.choices[0]
        calls = [(f.name, json.loads(f.arguments)) for f in functions(choice.message)]
        # The last call may be cut short by max_tokens.
        return calls[:-1] if choice.finish_reason == "length" else calls

    assert called(OPENAI_BASH["function"]["parameters"]) == [("Bash", {"command": "echo hi"})]
    only_ls = {
        "type": "object",
        "properties": {"command": {"enum": ["ls"]}},
        "required": ["command"],
        "additionalProperties": False,
    }
    # The script, thrown off its course, calls again; every call is held to the schema.
    held = called(only_ls)
    assert held and set(map(repr, held)) == {repr(("Bash", {"command": "ls"}))}
    message = anthropic_client(qwen3_server).messages.create(
        model="forced",
        max_tokens=200,
        messages=RUN,
        tools=[{**BASH, "input_schema": only_ls, "strict": True}],
    )
    uses = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    uses = uses[:-1] if message.stop_reason == "max_tokens" else uses
    assert uses and all(use == ("Bash", {"command": "ls"}) for use in uses)


def test_openai_sdk_streams_the_tool_calls(qwen3_server: RunningServer) -> None:
    stream = openai_client(qwen3_server).chat.completions.create(
        model="forced",
        max_tokens=200,
        messages=OPENAI_RUN,
        tools=[OPENAI_BASH],
        stream=True,
    )
    names: list[str] = []
    arguments: list[str] = []
    finish = None
    text = ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for call in delta.tool_calls or []:
            if call.function and call.function.name:
                names.append(call.function.name)
            if call.function and call.function.arguments:
                arguments.append(call.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert names == ["Bash"]
    assert json.loads("".join(arguments)) == {"command": "echo hi"}
    assert "tool_call" not in text


# The nonce Claude Code's Bash call writes (in quotes and brackets: a value with `<` and `"`).
NONCE = secrets.token_hex(8)


@dataclass
class FamilyServer:
    family: str
    server: RunningServer
    command: str  # the Bash command every first turn calls (timeout 5000, an integer)
    target: Path  # the file it writes


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FamilyServer]:
    """One server per family, shared by its SDK, prefix-reuse and Claude Code tests: the model
    calls Bash, and answers a conversation that holds a tool result."""
    family = request.param
    tmp = tmp_path_factory.mktemp(f"family-{family}")
    target = tmp / "work" / "nonce.txt"
    target.parent.mkdir()
    command = f'echo "<{NONCE}>" > {target}'
    model = forced_model_dir(
        tmp,
        family,
        [
            Script(answer(family, "The nonce is written."), when=TOOL_RESULT[family]),
            Script(bash_call(family, command, timeout=5000)),
        ],
    )
    running = start_server(tmp, *serve_args(model))
    yield FamilyServer(family, running, command, target)
    stop_server(running)


def test_sdks_get_each_familys_tool_call(family_server: FamilyServer) -> None:
    """The family's own call markup, written by the model token by token in its real vocabulary
    (or, for the families without a published tokenizer, in Qwen3's), reaches both SDKs as a
    tool call with arguments typed by the schema, streamed and not; the turn that sends its
    result back reuses the whole first prompt from the prefix cache."""
    server = family_server.server
    expected = [("Bash", {"command": family_server.command, "timeout": 5000})]
    claude = anthropic_client(server)
    message = claude.messages.create(model="forced", max_tokens=300, messages=RUN, tools=[BASH])
    assert message.stop_reason == "tool_use"
    calls = [b for b in message.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in calls] == expected
    assert not [b for b in message.content if b.type == "text" and b.text.strip()]
    first_prompt = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    result: MessageParam = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "a b"}],
    }
    reply = claude.messages.create(
        model="forced",
        max_tokens=300,
        messages=[*RUN, {"role": "assistant", "content": message.content}, result],
        tools=[BASH],
    )
    assert [b.text for b in reply.content if b.type == "text"] == ["The nonce is written."], reply
    # All of it but its last token, which the engine feeds at the first decode step.
    assert (reply.usage.cache_read_input_tokens or 0) >= first_prompt - 1
    with claude.messages.stream(model="forced", max_tokens=300, messages=RUN, tools=[BASH]) as s:
        events = list(s)
        final = s.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == expected
    fragments = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert len(fragments) > 1 and json.loads("".join(fragments)) == expected[0][1]
    gpt = openai_client(server)
    completion = gpt.chat.completions.create(
        model="forced", max_tokens=300, messages=OPENAI_RUN, tools=[OPENAI_BASH]
    )
    tool_calls = completion.choices[0].message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls] == expected  # type: ignore[union-attr]
    assert completion.choices[0].finish_reason == "tool_calls"
    chunks = gpt.chat.completions.create(
        model="forced", max_tokens=300, messages=OPENAI_RUN, tools=[OPENAI_BASH], stream=True
    )
    names: list[str] = []
    arguments: list[str] = []
    finish = None
    for chunk in chunks:
        if not chunk.choices:
            continue
        for call in chunk.choices[0].delta.tool_calls or []:
            if call.function and call.function.name:
                names.append(call.function.name)
            if call.function and call.function.arguments:
                arguments.append(call.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["Bash"] and finish == "tool_calls"
    assert json.loads("".join(arguments)) == expected[0][1]


def claude_code_tools() -> list[ToolParam]:
    """Twenty tools the size Claude Code sends (long descriptions with usage notes, schemas
    with described properties): the bulk of every turn's prompt."""
    names = [
        "Bash", "Read", "Write", "Edit", "MultiEdit", "Glob", "Grep", "LS", "Task", "TodoWrite",
        "WebFetch", "WebSearch", "NotebookEdit", "BashOutput", "KillShell", "ExitPlanMode",
        "SlashCommand", "AskUserQuestion", "Skill", "ListMcpResources",
    ]  # fmt: skip
    notes = [
        "Always prefer {n} over improvised shell pipelines when the task is what {n} is for.",
        "Call {n} with absolute paths; relative paths are resolved against the project root.",
        "When several {n} calls are independent, send them in one message so they run together.",
        "Results of {n} longer than 30000 characters are truncated; narrow the request instead.",
        "Never use {n} to bypass a permission the user has denied; ask them instead.",
        "Explain briefly why you call {n} when the reason is not obvious from the conversation.",
        "If {n} fails, read the error, fix the arguments and retry once before asking the user.",
        "Do not call {n} for information already present in the conversation or in CLAUDE.md.",
    ]
    tools: list[ToolParam] = []
    for name in names:
        description = f"The {name} tool. Use it when the task needs {name.lower()}.\n\nUsage:\n"
        description += "\n".join(f"- {note.format(n=name)}" for note in notes)
        properties: dict[str, Any] = {
            "command" if name == "Bash" else "path": {
                "type": "string",
                "description": f"What {name} acts on, written out in full.",
            },
            "timeout": {"type": "integer", "description": "Milliseconds (up to 600000)."},
            "description": {"type": "string", "description": "Five to ten words on what it does."},
            "options": {
                "type": "object",
                "description": f"Rarely needed switches of {name}.",
                "properties": {"verbose": {"type": "boolean"}, "limit": {"type": "integer"}},
            },
        }
        tools.append(
            {
                "name": name,
                "description": description,
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


def claude_code_system(turn: int) -> list[TextBlockParam]:
    """A system prompt the length of Claude Code's (its billing header changes every turn and
    is not rendered)."""
    topics = ["tone", "proactiveness", "conventions", "code style", "task management",
              "tool use", "git", "testing", "security", "file references"]  # fmt: skip
    sections = []
    for i, topic in enumerate(topics):
        rules = "\n".join(
            f"- Rule {i}.{j} on {topic}: keep answers short, check your work against the "
            f"repository's own conventions, and say what you changed and why (case {j})."
            for j in range(8)
        )
        sections.append(f"# {topic.capitalize()}\n{rules}")
    return [
        {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.0.{turn}; cch={turn};"},
        {"type": "text", "text": "You are Claude Code, an interactive CLI tool.\n\n"
         + "\n\n".join(sections)},
    ]  # fmt: skip


# The families whose templates drop the reasoning of the turns before the last user message
# (Qwen3's and DeepSeek V3.1's do too, but their scripted calls do not reason): turn 3's prompt
# holds turn 1's call without the reasoning the model wrote before it.
DROPS_EARLIER_REASONING = ("qwen3.5", "glm-4.6", "kimi-k2", "minimax-m2")


def least_reuse(family: str, turn: int, prompts: list[int], kept: list[int]) -> int:
    """How many tokens turn `turn` (2 or 3) reads from the prefix cache at least: all that the
    previous turn left there (its prompt and reply, less the reply's last token, never fed)
    where the template renders that reply back as the model wrote it, token for token."""
    if family == "gpt-oss" and turn == 2:
        # The template writes an earlier call's recipient in the message header
        # (`<|start|>assistant to=functions.Bash<|channel|>commentary json<|message|>`); the
        # model wrote it after the channel (`<|channel|>commentary to=functions.Bash
        # <|constrain|>json<|message|>`, harmony's documented form): the previous prompt, no reply.
        return prompts[0]
    if family in DROPS_EARLIER_REASONING and turn == 3:
        # Turn 1's prompt, less the reasoning opening its generation prompt ends with
        # (`\n<think>\n` at most).
        return prompts[0] - 3
    # GLM-4.6, MiniMax M2 and Seed-OSS run on the Qwen3 vocabulary, where their tags are text.
    # Their templates render the reply back as written (the call and its reasoning:
    # test_bash_call_is_what_the_template_renders_for_a_call), but BPE merges the tag beside it
    # with the reply's first or last token: GLM's `<|assistant|>` ends with `>`, which merges
    # with the reply's `\n` (the prompt but its last token is reused, none of the reply); the
    # reply's last `>` or `.` merges with MiniMax's `[e~[` or Seed's `<seed:eos>` after it (one
    # token short). In their own vocabularies these tags are special tokens, which never merge.
    if family == "glm-4.6" and turn == 2:
        return prompts[0] - 1
    if family in ("minimax-m2", "seed-oss"):
        return kept[turn - 2] - 1
    return kept[turn - 2]


def test_multi_turn_tool_conversation_reuses_the_prompt(family_server: FamilyServer) -> None:
    """A Claude Code-shaped conversation (long system prompt, twenty tools): turn 1 asks, the
    model calls Bash; turn 2 returns the result and the model answers; turn 3 asks again.
    Turns 2 and 3 read >= 90% of their prompt from the prefix cache. A finished turn leaves its
    prompt and reply in the prefix cache, so the next turn reads all of it where the template
    renders the reply back as the model wrote it (`least_reuse`: where it does not)."""
    family = family_server.family
    claude = anthropic_client(family_server.server)
    tools = claude_code_tools()
    messages: list[MessageParam] = [{"role": "user", "content": "Write the nonce to the file."}]
    shares = []
    prompts: list[int] = []
    kept: list[int] = []  # what each turn left in the prefix cache
    reads: list[int] = []  # what turns 2 and 3 read from it
    for turn in (1, 2, 3):
        reply = claude.messages.create(
            model="forced",
            max_tokens=300,
            system=claude_code_system(turn),
            messages=messages,
            tools=tools,
        )
        usage = reply.usage
        cached = usage.cache_read_input_tokens or 0
        prompts.append(usage.input_tokens + cached)
        kept.append(prompts[-1] + usage.output_tokens - 1)
        shares.append(cached / prompts[-1])
        if turn > 1:
            reads.append(cached)
        messages.append({"role": "assistant", "content": reply.content})
        if turn == 1:
            call = next(b for b in reply.content if b.type == "tool_use")
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": call.id, "content": "done\n"}
                    ],
                }
            )
        else:
            assert [b.text for b in reply.content if b.type == "text"] == ["The nonce is written."]
            messages.append({"role": "user", "content": "Thanks. Now list the directory."})
    print(
        f"\nreuse {family}: {shares[1]:.1%} {shares[2]:.1%} of {prompts[-1]};",
        *(f"{read}/{previous}" for read, previous in zip(reads, kept, strict=False)),
    )
    assert shares[1] >= 0.9 and shares[2] >= 0.9, shares
    for turn, read in enumerate(reads, 2):
        assert least_reuse(family, turn, prompts, kept) <= read <= kept[turn - 2], (turn, reads)


REASONING = {
    "qwen3": "<think>\nLet me think.\n</think>\n\nThe answer.",
    "gpt-oss": (
        "<|channel|>analysis<|message|>Let me think.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>The answer.<|return|>"
    ),
    # Its template opens <think> itself when thinking is on (and closes it when off).
    "deepseek-v3.1": "Let me think.</think>The answer.",
}


@pytest.mark.parametrize("family", list(REASONING))
def test_reasoning_reaches_the_sdks_as_thinking(tmp_path: Path, family: str) -> None:
    model = forced_model_dir(tmp_path, family, script=REASONING[family])
    server = start_server(tmp_path, *serve_args(model))
    try:
        message = anthropic_client(server).messages.create(
            model="forced",
            max_tokens=200,
            messages=[{"role": "user", "content": "hi"}],
            thinking={"type": "enabled", "budget_tokens": 100},
        )
        blocks = [(b.type, getattr(b, b.type, None)) for b in message.content]
        assert blocks == [("thinking", "Let me think."), ("text", "The answer.")]
        assert message.stop_reason == "end_turn"
        if family == "deepseek-v3.1":
            return  # an OpenAI request without reasoning turns its thinking off
        completion = openai_client(server).chat.completions.create(
            model="forced", max_tokens=200, messages=[{"role": "user", "content": "hi"}]
        )
        reply = completion.choices[0].message
        assert reply.content == "The answer."
        assert (reply.model_extra or {}).get("reasoning_content") == "Let me think."
        check_responses_reasoning(openai_client(server))
    finally:
        stop_server(server)


def check_responses_reasoning(client: openai.OpenAI) -> None:
    """Responses: a reasoning item, raw text or (when asked) a summary, whose encrypted_content
    is opaque (tests/test_codex.py replays it; test_responses_api.py decodes it)."""
    first = client.responses.create(
        model="forced", input="hi", include=["reasoning.encrypted_content"], store=False
    )
    reasoning, message = first.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert [part.text for part in reasoning.content or []] == ["Let me think."]
    assert reasoning.encrypted_content and "Let me think" not in reasoning.encrypted_content
    assert first.output_text == "The answer."

    with client.responses.stream(
        model="forced", input="hi", reasoning={"summary": "auto"}
    ) as stream:
        summary = "".join(
            e.delta for e in stream if e.type == "response.reasoning_summary_text.delta"
        )
        final = stream.get_final_response()
    assert summary == "Let me think."
    assert final.output[0].summary[0].text == summary  # type: ignore[union-attr]


def test_concurrent_requests_each_get_their_own_script(qwen3_server: RunningServer) -> None:
    """Rows of different lengths share the batch (left padding), long prompts are prefilled in
    chunks while others decode, repeats reuse cached prefixes: each row still follows the
    script its own prompt picks, to the token."""
    filler = " ".join(f"word{i}" for i in range(150))  # several 64-token prefill chunks
    prompts = {
        "apple": "Apples are red, apples are sweet, apples are red.",
        "banana": "Bananas are yellow.",
        "cherry": "Hello from a forced model.",
    }
    jobs = [
        (start, start + " " + filler * (n % 3) + f" #{n}")
        for n in range(12)
        for start in [("apple", "banana", "cherry")[n % 3]]
    ]
    client = anthropic_client(qwen3_server)

    def ask(job: tuple[str, str]) -> tuple[str, str, int]:
        message = client.messages.create(
            model="forced", max_tokens=100, messages=[{"role": "user", "content": job[1]}]
        )
        text = "".join(b.text for b in message.content if b.type == "text")
        return job[0], text, message.usage.cache_read_input_tokens or 0

    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(ask, jobs))
        # The same prompts again once the first ones are done (submitted with them, whether they
        # found a cached prefix depended on timing): prefix-cache hits.
        answers += pool.map(ask, jobs[:3])
    for start, text, _ in answers:
        assert text == prompts[start], (start, text)
    assert any(cached > 0 for _, _, cached in answers)


def test_a_forced_tool_choice_continues_the_opening_in_the_prompt(tmp_path: Path) -> None:
    """With tool_choice naming Bash, the prompt already ends with the call's opening
    (`<tool_call>\\n{"name": "Bash", "arguments": `): the model writes only the rest."""
    model = forced_model_dir(tmp_path, "qwen3", script='{"command": "echo hi"}}\n</tool_call>')
    server = start_server(tmp_path, *serve_args(model))
    try:
        message = anthropic_client(server).messages.create(
            model="forced",
            max_tokens=100,
            messages=[{"role": "user", "content": "hi"}],
            tools=[BASH],
            tool_choice={"type": "tool", "name": "Bash"},
        )
        calls = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
        assert calls == [("Bash", {"command": "echo hi"})]
        completion = openai_client(server).chat.completions.create(
            model="forced",
            max_tokens=100,
            messages=[{"role": "user", "content": "hi"}],
            tools=[OPENAI_BASH],
            tool_choice={"type": "function", "function": {"name": "Bash"}},
        )
        tool_calls = completion.choices[0].message.tool_calls or []
        assert [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls] == [  # type: ignore[union-attr]
            ("Bash", {"command": "echo hi"})
        ]
    finally:
        stop_server(server)


def test_gpt_oss_vocabulary_plain_text(tmp_path: Path) -> None:
    model = forced_model_dir(
        tmp_path, "gpt-oss", script="<|channel|>final<|message|>Hello from gpt-oss.<|return|>"
    )
    server = start_server(tmp_path, *serve_args(model))
    try:
        message = anthropic_client(server).messages.create(
            model="forced", max_tokens=100, messages=[{"role": "user", "content": "hi"}]
        )
        text = "".join(b.text for b in message.content if b.type == "text")
        assert text == "Hello from gpt-oss."  # the final channel's text, no harmony markup
        assert message.stop_reason == "end_turn"
        completion = openai_client(server).chat.completions.create(
            model="forced", max_tokens=100, messages=[{"role": "user", "content": "hi"}]
        )
        assert completion.choices[0].message.content == "Hello from gpt-oss."
        assert completion.choices[0].finish_reason == "stop"
    finally:
        stop_server(server)


def test_gpt_oss_structured_output_is_its_final_answer(tmp_path: Path) -> None:
    """A reply held to a JSON schema on a harmony model: the prompt opens the final channel (no
    analysis), the grammar holds the answer, `<|return|>` ends it; the client gets the JSON as
    content, on both APIs."""
    answer = '{"greeting":"hi"}'
    model = forced_model_dir(
        tmp_path, "gpt-oss", script=f"<|channel|>final<|message|>{answer}<|return|>"
    )
    server = start_server(tmp_path, *serve_args(model))
    schema = {
        "type": "object",
        "properties": {"greeting": {"type": "string"}},
        "required": ["greeting"],
        "additionalProperties": False,
    }
    try:
        completion = openai_client(server).chat.completions.create(
            model="forced",
            max_tokens=100,
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "g", "schema": schema}},
        )
        assert completion.choices[0].message.content == answer
        assert completion.choices[0].finish_reason == "stop"
        message = anthropic_client(server).messages.create(
            model="forced",
            max_tokens=100,
            messages=[{"role": "user", "content": "hi"}],
            output_config={"format": {"type": "json_schema", "schema": schema}},
        )
        assert [b.text for b in message.content if b.type == "text"] == [answer]
    finally:
        stop_server(server)


# Claude Code's arguments for the family server's round trip: Bash allowed, a JSON result.
WRITE_THE_NONCE = (
    "--allowedTools", "Bash", "-p", "Write the nonce to the file.", "--output-format", "json"
)  # fmt: skip


def test_claude_code_runs_the_forced_tool_call_and_gets_the_answer(
    family_server: FamilyServer, tmp_path: Path
) -> None:
    """The model's first turn is a Bash call that writes a nonce; Claude Code really runs it and
    sends the result; the model's second turn (its prompt holds a tool result) is plain text."""
    target = family_server.target
    target.unlink(missing_ok=True)
    run = run_claude_code(
        family_server.server,
        target.parent,
        "--bare",
        "--system-prompt",
        "You are a helpful assistant.",
        "--tools",
        "Bash",
        *WRITE_THE_NONCE,
    )
    assert run.returncode == 0, run.stdout + run.stderr + family_server.server.log()
    result = json.loads(run.stdout)
    assert result["is_error"] is False, result
    assert result["result"].strip() == "The nonce is written."
    assert result["num_turns"] >= 2
    assert target.read_text().strip() == f"<{NONCE}>"


def test_claude_code_with_its_default_settings_runs_the_call_and_continues(
    family_server: FamilyServer,
) -> None:
    """No `--bare`: Claude Code's own ~12k-token system prompt and tools (deferred ones too).
    The tool round trip ends with exit 0, and `-c` sends the whole session again, which the
    server finds in its prefix cache."""
    target = family_server.target
    target.unlink(missing_ok=True)
    first = run_claude_code(family_server.server, target.parent, *WRITE_THE_NONCE)
    assert first.returncode == 0, first.stdout + first.stderr + family_server.server.log()
    result = json.loads(first.stdout)
    assert result["result"].strip() == "The nonce is written."
    assert target.read_text().strip() == f"<{NONCE}>"
    usage = result["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] > 2 * 9_000  # two requests

    again = run_claude_code(
        family_server.server, target.parent, "-c", "-p", "Thanks.", "--output-format", "json"
    )
    assert again.returncode == 0, again.stdout + again.stderr
    continued = json.loads(again.stdout)
    assert continued["result"].strip() == "The nonce is written."
    assert continued["num_turns"] == 1
    cached, computed = (continued["usage"][k] for k in ("cache_read_input_tokens", "input_tokens"))
    assert cached > 9_000 and computed < 200, continued["usage"]  # the new message, little else
