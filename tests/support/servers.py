"""Real mlxgate servers for tests: `mlxgate serve` (granian subprocesses) on free ports, and
their metrics."""

from __future__ import annotations

import os
from pathlib import Path

import httpx2  # what the anthropic and openai SDKs are built on

from mlxgate.bench.spawn import Server, free_port, mlxgate_command

__all__ = ["REPO", "STARTED", "RunningServer", "free_port", "metric", "start_server", "stop_server"]

REPO = Path(__file__).resolve().parents[2]


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
