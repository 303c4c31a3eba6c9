"""A real agent with its default settings against the embedded model as `make serve` serves it
(32k tokens of context, YaRN over SmolLM2's 8k): Codex's default first request (~10k tokens)
fits and is answered. The server caps replies (`--max-output-tokens`): Codex asks for no limit
and gets the cap."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agents import run_codex
from conftest import RunningServer, start_server, stop_server

REPLY_LIMIT = 64


@pytest.fixture(scope="module")
def embedded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(
        tmp_path_factory.mktemp("agents"), "--max-output-tokens", str(REPLY_LIMIT)
    )
    yield running
    stop_server(running)


def test_codex_default_first_request_is_answered(
    embedded_server: RunningServer, tmp_path: Path
) -> None:
    """While the prompt prefills (minutes on a CPU), the stream's keep-alive events hold Codex's
    idle timer off."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    run = run_codex(embedded_server, "Say hello.", workdir)
    # The reply reached Codex. A 135M model at 4x its own context often repeats itself until the
    # cap (then Codex reports the response incomplete): a fact about the model, not the server.
    assert run.message().strip(), json.dumps(run.events)[-2000:]
    if run.returncode != 0:
        assert run.failure() == "Incomplete response returned, reason: max_output_tokens"
    metrics = httpx.get(f"{embedded_server.url}/metrics").text
    prefilled = next(
        float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("mlxgate_engine_prefill_tokens_total ")
    )
    assert prefilled > 8192  # more than the model's own context
