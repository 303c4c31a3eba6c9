"""The Anthropic Messages API: messages, count_tokens and its model list."""

from mlxgate.api.anthropic.routes import AnthropicAPI

__all__ = ["AnthropicAPI"]
