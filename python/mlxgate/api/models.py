"""Model names: the served model, its aliases, which names a request may use, GET /v1/models."""

from __future__ import annotations

import time
from typing import Any

from mlxgate.api.errors import ApiError
from mlxgate.api.http import Scope, Send, header, send_json


class ModelNames:
    """One served model under its own name and its aliases (`--model-alias`).

    Requests may name any model unless `strict`; responses always report the served name.
    """

    def __init__(
        self,
        served: str,
        aliases: dict[str, str] | None = None,
        *,
        strict: bool = False,
        model_arg: str | None = None,
    ) -> None:
        aliases = aliases or {}
        for alias, target in aliases.items():
            if target not in (served, model_arg):
                raise ValueError(
                    f"--model-alias {alias}={target}: this server serves one model, {served!r}; "
                    f"an alias must name it (--model-alias {alias}={served})"
                )
        self.served = served
        self.names = [served, *(alias for alias in aliases if alias != served)]
        self.strict = strict
        self.created = int(time.time())

    def check(self, requested: str) -> None:
        """Refuse a model name the server does not answer to (only with `strict`)."""
        if self.strict and requested not in self.names:
            raise ApiError(
                404,
                f"model: {requested!r} is not served here; this server answers to "
                + ", ".join(repr(name) for name in self.names),
                code="model_not_found",
                param="model",
                should_retry=False,
            )

    def _entry(self, name: str, anthropic: bool) -> dict[str, Any]:
        if anthropic:
            created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created))
            return {"type": "model", "id": name, "display_name": name, "created_at": created_at}
        return {"id": name, "object": "model", "created": self.created, "owned_by": "mlxgate"}

    async def list(self, scope: Scope, send: Send) -> None:
        """Anthropic's list shape when the request has `anthropic-version`, else OpenAI's."""
        if header(scope, b"anthropic-version") is not None:
            entries = [self._entry(name, anthropic=True) for name in self.names]
            page = {
                "data": entries,
                "has_more": False,
                "first_id": self.names[0],
                "last_id": self.names[-1],
            }
            await send_json(send, 200, page)
        else:
            entries = [self._entry(name, anthropic=False) for name in self.names]
            await send_json(send, 200, {"object": "list", "data": entries})

    async def retrieve(self, scope: Scope, send: Send, model_id: str) -> None:
        if model_id not in self.names:
            raise ApiError(404, f"model: {model_id!r} is not served here", code="model_not_found")
        anthropic = header(scope, b"anthropic-version") is not None
        await send_json(send, 200, self._entry(model_id, anthropic))
