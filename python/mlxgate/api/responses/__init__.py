"""The OpenAI Responses API (`/v1/responses`): what OpenAI's Codex CLI speaks."""

from mlxgate.api.responses.routes import ResponsesAPI

__all__ = ["ResponsesAPI"]
