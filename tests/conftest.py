"""Shared fixtures: real mlxgate servers (granian subprocesses, embedded model) on free ports, and
one in-process app whose engine can be made to fail on demand. The helpers they use are in
`support/`."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest

import mlxgate  # noqa: F401  (preloads OpenBLAS before any test module imports mlx.core)
from support.in_process import FaultyRouter, InProcessServer
from support.servers import STARTED, RunningServer, start_server, stop_server


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


@pytest.fixture(scope="session")
def in_process() -> Iterator[InProcessServer]:
    from mlxgate.app import build_app
    from mlxgate.config import Config
    from mlxgate.engine import Engine

    app = build_app(Config(allowed_hosts=("mlxgate.test",)))  # the ASGI transport's host
    engine = app.engine
    assert isinstance(engine, Engine), engine
    router = FaultyRouter(engine.router)
    engine.router = router  # type: ignore[assignment]  # a stand-in with the Router's methods
    yield InProcessServer(app, router)
    app.engine.stop()
