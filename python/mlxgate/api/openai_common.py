"""What the two OpenAI dialects (Chat Completions, Responses) share: how they read `tool_choice`
and how they word admission errors."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from mlxgate import prompts
from mlxgate.api.errors import invalid
from mlxgate.api.pipeline import COMMON_ADMISSION_ERRORS, AdmissionErrors, prompt_too_long
from mlxgate.engine import PromptTooLong

# A dialect's own shape of a named `tool_choice`.
Named = TypeVar("Named")


def tool_choice(
    choice: str | Named | None,
    named: Callable[[Named], prompts.ToolChoice],
    *,
    any_callable: bool = True,
) -> prompts.ToolChoice:
    """A request's `tool_choice`: "auto" (or none), "none", "required" (some tool; the model
    chooses where `any_callable` is False: the request has no tool the model can call), or a
    named tool, which `named` reads from the dialect's shape."""
    if choice is None or choice == "auto":
        return prompts.ToolChoice()
    if choice == "none":
        return prompts.ToolChoice("none")
    if choice == "required":
        return prompts.ToolChoice("any") if any_callable else prompts.ToolChoice()
    if isinstance(choice, str):
        raise invalid(f"tool_choice: {choice!r} is not one of 'auto', 'none', 'required'")
    return named(choice)


def admission_errors(prompt_field: str) -> AdmissionErrors:
    """An OpenAI dialect's admission table: a prompt over the context is OpenAI's
    `context_length_exceeded`, naming the field the prompt came in (`prompt_field`)."""
    return {
        **COMMON_ADMISSION_ERRORS,
        PromptTooLong: lambda e: prompt_too_long(
            e, code="context_length_exceeded", param=prompt_field
        ),
    }
