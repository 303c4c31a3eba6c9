"""The ASGI app with the real model in this process, and the fault switch its tests arm."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx2

from mlxgate.api.reader import events as reader_events

if TYPE_CHECKING:
    from mlxgate._native import FinishReason, Router
    from mlxgate.app import App


class FaultyRouter:
    """The engine's stream router with a fault switch: armed with `fail_after(n)`, the engine
    step after the next n raises inside the engine thread, as a bug in generation would."""

    def __init__(self, router: Router) -> None:
        self._router = router
        self._steps_until_fault: int | None = None

    def fail_after(self, steps: int) -> None:
        self._steps_until_fault = steps

    def step(self, *args: Any) -> list[tuple[int, FinishReason]]:
        if self._steps_until_fault is not None:
            if self._steps_until_fault == 0:
                self._steps_until_fault = None
                raise RuntimeError("injected fault")
            self._steps_until_fault -= 1
        return self._router.step(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._router, name)

    def __len__(self) -> int:
        return len(self._router)


@dataclass
class InProcessServer:
    """The ASGI app with the real model in this process, reached through an ASGI transport."""

    app: App
    router: FaultyRouter
    base_url: str = "http://mlxgate.test"

    def http_client(self) -> httpx2.AsyncClient:
        return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=self.app))


# Faults for the in-process app (`monkeypatch.setattr` them over the real pieces).


def broken_render(*args: Any, **kwargs: Any) -> None:
    """Stands in for `mlxgate.prompts.Renderer.render`: a bug before the response's headers."""
    raise RuntimeError("a bug in rendering")


async def broken_after_first_frames(reader: Any) -> AsyncIterator[tuple[bytes, int]]:
    """Stands in for `mlxgate.api.reader.events`: a bug after the response's headers."""
    async for taken in reader_events(reader):
        yield taken
        raise RuntimeError("a bug in the stream writer")
