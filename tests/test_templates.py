"""The prompts mlxgate renders are the ones transformers' `apply_chat_template` renders (what
mlx-lm's tokenizer calls): every family's real template and tokenizer (tests/fixtures), the
embedded GGUF's, and every render the chat layer asks for (its probes at load, plain turns,
tools, calls and results, reasoning, thinking on and off)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jinja2
import pytest

from mlxgate import prompts
from mlxgate.models import embedded, gguf
from mlxgate.models.tokenizer import ChatTokenizer, TemplateError
from support.forced import FAMILIES, write_tokenizer

TOOL = {
    "type": "function",
    "function": {
        "name": "Bash",
        "description": "Run a shell command.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
            "required": ["command"],
        },
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "Bash", "arguments": {"command": "ls -la", "timeout": 5}},
}
CONVERSATIONS = [
    prompts.Conversation([{"role": "user", "content": "Name three colors."}]),
    prompts.Conversation(
        [
            {"role": "system", "content": 'You are terse. Ünïcödé, 東京 and "quotes".'},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
            {"role": "user", "content": "What is 2+2?"},
        ],
        thinking=True,
    ),
    prompts.Conversation(
        [
            {"role": "user", "content": "List the files."},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "a.txt\nb.txt"},
            {"role": "user", "content": "And now?"},
        ],
        tools=[TOOL],
        thinking=False,
    ),
    prompts.Conversation(
        [{"role": "user", "content": "Run ls."}],
        tools=[TOOL],
        tool_choice=prompts.ToolChoice("tool", "Bash"),
    ),
    # Claude Code's: a system message after the user's, then a tool loaded by a tool search.
    prompts.Conversation(
        [
            {"role": "system", "content": "You are an agent."},
            {"role": "user", "content": "List the files."},
            {"role": "system", "content": "# Environment\ncwd: /tmp"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
        ],
        loaded_tools=[TOOL],
    ),
]


def directories() -> Iterator[tuple[str, Path]]:
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            yield family, write_tokenizer(family, Path(tmp) / family)
        smollm = Path(tmp) / "smollm2"
        gguf.write_tokenizer(gguf.read_metadata(embedded.path()), smollm)
        yield "smollm2 (GGUF)", smollm


@pytest.fixture(scope="module")
def renders() -> dict[str, list[tuple[str, str | None]]]:
    """Per family: each render the chat layer asked for, as (ours, transformers' or None
    where transformers refuses the template)."""
    return {family: compared(directory) for family, directory in directories()}


def compared(directory: Path) -> list[tuple[str, str | None]]:
    from mlx_lm.utils import load_tokenizer

    tokenizer = ChatTokenizer.from_pretrained_dir(directory)
    reference = load_tokenizer(directory)._tokenizer
    calls: list[tuple[list[dict[str, Any]], dict[str, Any]]] = []
    ours = tokenizer.render

    def recording(messages: list[dict[str, Any]], **kwargs: Any) -> str:
        calls.append((messages, kwargs))
        return ours(messages, **kwargs)

    tokenizer.render = recording  # type: ignore[method-assign]
    renderer = prompts.Renderer(tokenizer)
    for conversation in CONVERSATIONS:
        renderer.render(conversation)
    pairs: list[tuple[str, str | None]] = []
    for messages, kwargs in calls:
        theirs: str | None
        try:
            theirs = reference.apply_chat_template(messages, tokenize=False, **kwargs)
        except jinja2.exceptions.SecurityError:
            theirs = None
        except jinja2.exceptions.TemplateError as exc:  # a probe the template refuses
            theirs = f"refused: {exc}"
        try:
            pairs.append((ours(messages, **kwargs), theirs))
        except TemplateError as exc:
            pairs.append((f"refused: {exc}", theirs))
    return pairs


@pytest.mark.parametrize("family", [*FAMILIES, "smollm2 (GGUF)"])
def test_prompts_equal_transformers_apply_chat_template(
    family: str, renders: dict[str, list[tuple[str, str | None]]]
) -> None:
    pairs = renders[family]
    assert len(pairs) >= len(CONVERSATIONS)
    for ours, theirs in pairs:
        if theirs is None:
            # transformers' sandbox is immutable, and Kimi K2's template appends each call's id
            # to a list: mlxgate's mutable sandbox renders it, with every other render equal.
            assert family == "kimi-k2"
            assert "<|tool_call_begin|>functions." in ours
            continue
        assert ours == theirs
