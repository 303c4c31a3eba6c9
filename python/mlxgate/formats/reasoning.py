"""Reasoning formats: how a model's reasoning is delimited in its output and where its template
reads earlier reasoning back, chosen from the chat template like the tool formats."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mlxgate.formats.common import Message, unchanged

# The neutral conversation carries an assistant turn's reasoning here (the Hugging Face
# convention most templates read as is).
FIELD = "reasoning_content"


def _thinking_blocks(messages: list[Message]) -> list[Message]:
    """Mistral templates read reasoning as a `thinking` content block before the text."""
    out = []
    for message in messages:
        reasoning = message.get(FIELD)
        if message["role"] == "assistant" and reasoning:
            turn = {k: v for k, v in message.items() if k != FIELD}
            blocks = [{"type": "thinking", "thinking": reasoning}]
            if text := turn.get("content"):
                blocks.append({"type": "text", "text": text})
            turn["content"] = blocks
            message = turn
        out.append(message)
    return out


def _dropped(messages: list[Message]) -> list[Message]:
    return [{k: v for k, v in m.items() if k != FIELD} for m in messages]


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    # What the router splits off as reasoning; None where the tool format parses it (harmony).
    tags: tuple[str, str] | None
    detect: Callable[[str], bool]
    prepare: Callable[[list[Message]], list[Message]] = unchanged
    # What opens the answer where reasoning is a channel of its own (harmony's final channel):
    # a reply held to a format (structured output) starts there, with no reasoning.
    answer: str = ""


# Detection order: the first whose `detect` accepts the template; `none` is the fallback.
REASONING_FORMATS: dict[str, ReasoningFormat] = {
    f.name: f
    for f in (
        ReasoningFormat(
            "harmony", None, lambda t: "<|channel|>" in t, answer="<|channel|>final<|message|>"
        ),
        ReasoningFormat("seed", ("<seed:think>", "</seed:think>"), lambda t: "<seed:think>" in t),
        ReasoningFormat(
            "mistral", ("[THINK]", "[/THINK]"), lambda t: "[THINK]" in t, _thinking_blocks
        ),
        ReasoningFormat("think", ("<think>", "</think>"), lambda t: "<think>" in t),
        ReasoningFormat("none", None, lambda t: True, _dropped),
    )
}


def detect_reasoning_format(template: str) -> ReasoningFormat:
    return next(f for f in REASONING_FORMATS.values() if f.detect(template))
