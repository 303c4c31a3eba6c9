"""Runs the app under granian: one worker (the model lives in the process), HTTP/1.1."""

from __future__ import annotations

from granian.constants import HTTPModes, Interfaces
from granian.http import HTTP1Settings
from granian.server import Server

from mlxgate.config import Config


def serve(config: Config) -> None:
    config.to_env()
    Server(
        "mlxgate.app:create_app",
        factory=True,
        address=config.host,
        port=config.port,
        interface=Interfaces.ASGI,
        workers=1,
        # HTTP/2 stream resets are not reported to the app, so a cancel would go unnoticed.
        http=HTTPModes.http1,
        # Headers bounded in size (granian's default buffer) and in time (slowloris).
        http1_settings=HTTP1Settings(header_read_timeout=10_000),
        # The worker drains for --drain-timeout (api/drain.py), then ends what is left.
        workers_kill_timeout=int(config.drain_timeout) + 15,
        log_level=config.log_level,  # type: ignore[arg-type]
    ).serve()
