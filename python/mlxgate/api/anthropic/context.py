"""Anthropic's context management, applied to a request's conversation before it is rendered: the
`context_management.edits` (`clear_tool_uses_20250919`, `clear_thinking_20251015`,
`compact_20260112`) and the top-level `compaction` parameter. What the edits did is reported back
as Anthropic reports it (`context_management.applied_edits`).

Clearing edits replace old tool results (and, if asked, their calls' inputs) or old reasoning
with a placeholder; a compaction has the served model summarize the conversation
(api/compaction.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlxgate import prompts
from mlxgate.api.errors import invalid
from mlxgate.formats.reasoning import FIELD as REASONING

CLEARED_RESULT = "[This tool result was cleared to save context.]"
# Anthropic's defaults for the edits' triggers and what they keep.
CLEAR_TOOL_USES_TRIGGER = 100_000
CLEAR_TOOL_USES_KEEP = 3
COMPACT_TRIGGER = 150_000

# The rendered prompt's length in tokens, for the edits' `input_tokens` triggers.
Count = Callable[[prompts.Conversation], int]


@dataclass(frozen=True)
class Compaction:
    """The conversation is to be summarized by the model."""

    instructions: str | None
    # The client's instructions replace the summary prompt (the `compaction` parameter's) rather
    # than add to it (the `compact_20260112` edit's).
    replace: bool
    # Stop after the summary (stop reason `compaction`); else answer from the summary on.
    pause: bool


@dataclass
class Managed:
    """A conversation after the request's edits, and what they did."""

    conversation: prompts.Conversation
    applied: list[dict[str, Any]] = field(default_factory=list)
    compaction: Compaction | None = None


def _number(spec: Any, default: int, where: str) -> int:
    if spec is None:
        return default
    value = spec.get("value") if isinstance(spec, dict) else None
    if not isinstance(value, int) or value < 0:
        raise invalid(f"{where}.value: must be a non-negative integer")
    return value


def _tool_uses(messages: list[prompts.Message]) -> list[tuple[int, int, str]]:
    """Every tool call, oldest first: (message index, call index, tool name)."""
    return [
        (i, j, call["function"]["name"])
        for i, message in enumerate(messages)
        for j, call in enumerate(message.get("tool_calls") or [])
    ]


def _clear_tool_uses(
    conversation: prompts.Conversation, edit: dict[str, Any], where: str, count: Count
) -> dict[str, Any] | None:
    trigger = edit.get("trigger")
    kind = trigger.get("type", "input_tokens") if isinstance(trigger, dict) else "input_tokens"
    threshold = _number(trigger, CLEAR_TOOL_USES_TRIGGER, f"{where}.trigger")
    keep = _number(edit.get("keep"), CLEAR_TOOL_USES_KEEP, f"{where}.keep")
    excluded = set(edit.get("exclude_tools") or [])
    clear_inputs = edit.get("clear_tool_inputs") or False
    messages = conversation.messages
    uses = _tool_uses(messages)
    if kind == "tool_uses" and len(uses) < threshold:
        return None
    before = count(conversation)
    if kind == "input_tokens" and before < threshold:
        return None
    cleared = [use for use in uses[: max(len(uses) - keep, 0)] if use[2] not in excluded]
    if not cleared:
        return None
    edited = copy.deepcopy(messages)
    for i, j, name in cleared:
        call = edited[i]["tool_calls"][j]
        if clear_inputs is True or (isinstance(clear_inputs, list) and name in clear_inputs):
            call["function"]["arguments"] = {}
        for message in edited:
            if message["role"] == "tool" and message.get("tool_call_id") == call["id"]:
                message["content"] = CLEARED_RESULT
    trial = copy.copy(conversation)
    trial.messages = edited
    after = count(trial)
    least = edit.get("clear_at_least")
    if least is not None and before - after < _number(least, 0, f"{where}.clear_at_least"):
        return None
    conversation.messages = edited
    return {
        "type": "clear_tool_uses_20250919",
        "cleared_tool_uses": len(cleared),
        "cleared_input_tokens": max(before - after, 0),
    }


def _clear_thinking(
    conversation: prompts.Conversation, edit: dict[str, Any], where: str, count: Count
) -> dict[str, Any] | None:
    keep = edit.get("keep", {"type": "thinking_turns", "value": 1})
    if keep == "all":
        return None
    kept = _number(keep, 1, f"{where}.keep")
    thinking = [i for i, m in enumerate(conversation.messages) if m.get(REASONING)]
    cleared = thinking[: max(len(thinking) - kept, 0)]
    if not cleared:
        return None
    before = count(conversation)
    conversation.messages = [
        {k: v for k, v in m.items() if k != REASONING} if i in cleared else m
        for i, m in enumerate(conversation.messages)
    ]
    return {
        "type": "clear_thinking_20251015",
        "cleared_thinking_turns": len(cleared),
        "cleared_input_tokens": max(before - count(conversation), 0),
    }


def manage(
    conversation: prompts.Conversation,
    edits: list[dict[str, Any]],
    compaction: dict[str, Any] | None,
    count: Count,
) -> Managed:
    """`conversation` with `edits` applied in order, and whether it is to be compacted (the
    `compaction` parameter always; a `compact_20260112` edit past its trigger)."""
    managed = Managed(conversation)
    for index, edit in enumerate(edits):
        where = f"context_management.edits.{index}"
        kind = edit.get("type")
        if kind == "clear_tool_uses_20250919":
            applied = _clear_tool_uses(conversation, edit, where, count)
        elif kind == "clear_thinking_20251015":
            applied = _clear_thinking(conversation, edit, where, count)
        elif kind == "compact_20260112":
            threshold = _number(edit.get("trigger"), COMPACT_TRIGGER, f"{where}.trigger")
            if count(conversation) >= threshold:
                managed.compaction = Compaction(
                    edit.get("instructions"),
                    replace=False,
                    pause=bool(edit.get("pause_after_compaction")),
                )
            continue
        else:
            raise invalid(f"{where}.type: {kind!r} is not a context-management edit")
        if applied is not None:
            managed.applied.append(applied)
    if compaction is not None:
        if compaction.get("type", "summarize") != "summarize":
            raise invalid("compaction.type: must be 'summarize'")
        managed.compaction = Compaction(compaction.get("instructions"), replace=True, pause=True)
    return managed
