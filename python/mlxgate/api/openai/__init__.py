"""The OpenAI Chat Completions and Completions APIs (`/v1/chat/completions`, `/v1/completions`,
OpenAI's model list)."""

from mlxgate.api.openai.routes import OpenAIAPI

__all__ = ["OpenAIAPI"]
