"""Shared fixtures: real mlxgate servers (granian subprocesses, embedded model) on free ports, and
one in-process app whose engine can be made to fail on demand."""

from __future__ import annotations

import inspect
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx2  # what the anthropic and openai SDKs are built on
import pytest

import mlxgate  # noqa: F401  (preloads OpenBLAS before any test module imports mlx.core)
from mlxgate.api.reader import events as reader_events
from mlxgate.bench.spawn import Server, free_port, mlxgate_command

if TYPE_CHECKING:
    from mlxgate._native import Router
    from mlxgate.app import App

REPO = Path(__file__).resolve().parent.parent


# A real server: mlxgate.bench.spawn's, as `mlxgate bench --spawn` starts one.
RunningServer = Server
STARTED: list[Server] = []


def start_server(tmp_dir: Path, *extra_args: str, timeout_s: float = 120.0) -> RunningServer:
    """`mlxgate serve` with `extra_args` on a free port, its output in `tmp_dir`; an error that
    stops it from starting carries the log. Greedy for a request that sets no temperature
    (`--sampling-defaults server`), so that answers are the same every run, unless
    `extra_args` chooses (test_agent_defaults.py and test_sampling_defaults.py serve the
    model's own defaults, as `make serve` does)."""
    if "--sampling-defaults" not in extra_args:
        extra_args = ("--sampling-defaults", "server", *extra_args)
    port = free_port()
    server = Server(
        "mlxgate",
        mlxgate_command(port, extra_args),
        port,
        tmp_dir / f"server-{port}.log",
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        tracked=False,  # `mlxgate bench` stops the servers it tracks when a run ends
    )
    STARTED.append(server)
    try:
        server.start(timeout_s, poll_s=0.2)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}:\n{server.log()}") from None
    return server


def stop_server(server: RunningServer) -> None:
    server.stop(grace_s=15.0)


def metric(
    server: RunningServer, name: str, headers: dict[str, str] | None = None, **labels: str
) -> float:
    """The value of the /metrics sample `name` that has `labels` (besides any others, such as
    its model's); 0 before it is counted."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx2.get(f"{server.url}/metrics", headers=headers).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return float(sample.value)
    return 0.0


def pytest_sessionfinish() -> None:
    for server in STARTED:
        server.stop(grace_s=5.0)  # a server a failed test left running


# `make test-fast` runs the tests not marked slow. A test is slow when it, or a fixture it uses,
# starts a real server (`mlxgate serve`, `mlxgate bench --spawn`), loads a model's weights, or
# runs a model through the engine (the tiny models' `Served`).
SLOW_FIXTURES = {"server", "strict_server", "limited_server", "aliased_server", "in_process"}
SLOW_CALLS = ("start_server(", '"serve"', '"--spawn"', "load(None", "load_model(", "Served(")


def _starts_or_loads(function: Any) -> bool:
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    return any(call in source for call in SLOW_CALLS)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        fixtures = item._fixtureinfo.name2fixturedefs
        used = [defs[-1].func for defs in fixtures.values() if defs]
        if SLOW_FIXTURES & set(item.fixturenames) or any(
            _starts_or_loads(f) for f in [item.function, *used]
        ):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One server with the embedded model for the whole session, at its own 8,192-token context
    and rope: the checks that answers make sense (Paris, end_turn) hold for the model as trained;
    YaRN (the 32k default) changes short answers (docs/models.md). test_context.py and the
    Claude Code test with default settings serve the default."""
    running = start_server(tmp_path_factory.mktemp("server"), "--context-length", "8192")
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """An API key, a one-request queue and an output-token limit."""
    running = start_server(
        tmp_path_factory.mktemp("strict"),
        "--api-key", "sk-right",
        "--max-queued", "1",
        "--max-output-tokens", "4096",
    )  # fmt: skip
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """At most two requests in flight per client."""
    running = start_server(tmp_path_factory.mktemp("limited"), "--max-per-client", "2")
    yield running
    stop_server(running)


@pytest.fixture(scope="session")
def aliased_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """Answers only to the served model's name and two aliases."""
    running = start_server(
        tmp_path_factory.mktemp("aliased"),
        "--model-alias", "claude-local=SmolLM2-135M-Instruct",
        "--model-alias", "gpt-local=SmolLM2-135M-Instruct",
        "--strict-models",
    )  # fmt: skip
    yield running
    stop_server(running)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class FaultyRouter:
    """The engine's stream router with a fault switch: armed with `fail_after(n)`, the engine
    step after the next n raises inside the engine thread, as a bug in generation would."""

    def __init__(self, router: Router) -> None:
        self._router = router
        self._steps_until_fault: int | None = None

    def fail_after(self, steps: int) -> None:
        self._steps_until_fault = steps

    def step(self, *args: Any) -> list[int]:
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


@pytest.fixture(scope="session")
def in_process() -> Iterator[InProcessServer]:
    from mlxgate.app import build_app
    from mlxgate.config import Config

    app = build_app(Config(allowed_hosts=("mlxgate.test",)))  # the ASGI transport's host
    router = FaultyRouter(app.engine.router)
    app.engine.router = router  # type: ignore[assignment]
    yield InProcessServer(app, router)
    app.engine.stop()


# Faults for the in-process app (`monkeypatch.setattr` them over the real pieces).


def broken_render(*args: Any, **kwargs: Any) -> None:
    """Stands in for `mlxgate.prompts.Renderer.render`: a bug before the response's headers."""
    raise RuntimeError("a bug in rendering")


async def broken_after_first_frames(reader: Any) -> AsyncIterator[tuple[bytes, int]]:
    """Stands in for `mlxgate.api.reader.events`: a bug after the response's headers."""
    async for taken in reader_events(reader):
        yield taken
        raise RuntimeError("a bug in the stream writer")


def last_frames(sse: str, count: int) -> list[str]:
    """The last `count` frames of an SSE body, without their `id:` lines."""
    return [without_id(frame) for frame in sse.split("\n\n") if frame][-count:]


def without_id(frame: str) -> str:
    """An SSE frame without the `id:` line every event starts with."""
    assert frame.startswith(("id: ", ":")), frame
    return frame.split("\n", 1)[1] if frame.startswith("id: ") else frame
