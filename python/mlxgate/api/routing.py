"""Routes: which handler answers a method and path, and in which dialect it words errors."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from mlxgate._native import Dialect
from mlxgate.api.http import Receive, Scope, Send

Handler = Callable[[Scope, Receive, Send, bytes], Awaitable[None]]


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # matched as a suffix of the request path (a base-URL prefix is allowed)
    dialect: Dialect
    handler: Handler
    prefix: bool = False  # `path` may be followed by more (e.g. /v1/models/{id})
    # The route is this dialect's only when the request has this header.
    header: bytes | None = None

    def matches(self, path: str) -> bool:
        """Whether `path` is this route's, with or without the `/v1` (clients differ on whether
        the base URL they are given ends with it)."""
        bare = self.path.removeprefix("/v1")
        return bare in path if self.prefix else path.endswith(bare)


def path_tail(scope: Scope, route_path: str) -> str:
    """What follows a prefix route's path (`/v1/models/` -> the model id, which may hold `/`)."""
    return str(scope["path"]).rstrip("/").split(route_path.removeprefix("/v1"), 1)[1]
