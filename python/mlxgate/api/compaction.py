"""Compaction done by the served model, for every dialect that asks for it: the conversation so
far and an instruction to summarize it are rendered as one more user turn, the model writes the
summary through the engine like any reply (batched, cancellable, counted in usage), and the
dialect answers with it as its compaction item or block. A later request that carries the
compaction back sees the summary in its place, as a user turn.

The prompt of a compaction is the conversation's own prompt plus one turn, so it reuses the
conversation's KV from the prefix cache; the turn after it starts with the summary, and the cache
fills from there.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from mlxgate import prompts
from mlxgate.engine import Grammar, SamplingParams

if TYPE_CHECKING:
    from mlxgate.api.pipeline import Asked

# What the model is asked: a handoff summary another model (or itself, later) resumes from.
INSTRUCTION = (
    "Stop here and write a summary of the conversation so far, for whoever resumes it with "
    "only your summary in hand. Do not call any tool. Include:\n"
    "- the user's requests and intent, in their own words where it matters;\n"
    "- what has been done: decisions, files and code touched, commands run and their results;\n"
    "- errors met and how they were fixed;\n"
    "- what remains to be done, and the next step.\n"
    "Be concise and concrete: names, paths, values. Write only the summary."
)

# How a summary reads where the conversation it replaces was.
SUMMARY_HEADING = "The conversation so far was compacted. Its summary:"


def instruction(extra: str | None = None, *, replace: bool = False) -> prompts.Message:
    """The user turn that asks for the summary: ours, with the client's instructions added (or
    in its place, with `replace`); blank instructions count as none."""
    extra = (extra or "").strip()
    if not extra:
        return {"role": "user", "content": INSTRUCTION}
    return {"role": "user", "content": extra if replace else f"{INSTRUCTION}\n\n{extra}"}


def replaced(summary: str) -> prompts.Message:
    """The turn a compaction stands for when a client sends it back."""
    return {"role": "user", "content": f"{SUMMARY_HEADING}\n\n{summary.strip()}"}


def asking(
    conversation: prompts.Conversation, extra: str | None = None, *, replace: bool = False
) -> prompts.Conversation:
    """`conversation` with the summary asked for: its tools still shown (so its prompt is the
    conversation's plus one turn, from the prefix cache) but none forced, and no reasoning."""
    return dataclasses.replace(
        conversation,
        messages=prompts.merge_turns([*conversation.messages, instruction(extra, replace=replace)]),
        tool_choice=prompts.ToolChoice(),
        thinking=False,
        structured=False,
    )


def resumed(conversation: prompts.Conversation, summary: str) -> prompts.Conversation:
    """`conversation` from its summary on: its system message, then the summary."""
    system = [m for m in conversation.messages[:1] if m["role"] == "system"]
    return dataclasses.replace(conversation, messages=[*system, replaced(summary)])


@dataclasses.dataclass(frozen=True)
class Summarizing:
    """A request's summary generation: its model and sampling, not streamed, no reply format."""

    request: Asked
    stream: bool = False

    @property
    def model(self) -> str | None:
        return self.request.model

    @property
    def keep_alive(self) -> float | str | None:
        return self.request.keep_alive

    @property
    def speculative_decoding(self) -> bool:
        return self.request.speculative_decoding

    @property
    def temperature(self) -> float | None:
        return self.request.temperature

    @property
    def loop_guard(self) -> bool | None:
        return self.request.loop_guard

    def output_tokens(self) -> int | None:
        return self.request.output_tokens()

    def sampling(self, defaults: SamplingParams) -> SamplingParams:
        return self.request.sampling(defaults)

    def grammar(self) -> Grammar | None:
        return None
