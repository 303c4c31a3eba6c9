"""Model names: the served model, its aliases, and which names a request may use."""

from __future__ import annotations

import time

from mlxgate._native import ErrorKind
from mlxgate.api.errors import ApiError


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

    def check(self, requested: str | None) -> None:
        """Refuse a model name the server does not answer to (only with `strict`); no name is
        the served model."""
        if self.strict and requested is not None and requested not in self.names:
            raise ApiError(
                ErrorKind.NOT_FOUND,
                f"model: {requested!r} is not served here; this server answers to "
                + ", ".join(repr(name) for name in self.names),
                code="model_not_found",
                param="model",
                should_retry=False,
            )

    def listed(self, model_id: str) -> str:
        """`model_id` if it is listed (GET /v1/models/{id}), else a 404."""
        if model_id not in self.names:
            raise ApiError(
                ErrorKind.NOT_FOUND,
                f"model: {model_id!r} is not served here",
                code="model_not_found",
            )
        return model_id
