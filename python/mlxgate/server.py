"""Runs the app under granian: one worker (the model lives in the process), HTTP/1.1, a worker
that ends with granian's main process."""

from __future__ import annotations

import multiprocessing
from typing import TYPE_CHECKING

from granian.constants import HTTPModes, Interfaces
from granian.http import HTTP1Settings
from granian.server import Server

from mlxgate import parent_watch
from mlxgate.config import Config

if TYPE_CHECKING:
    from mlxgate.app import Loading


def serve(config: Config) -> None:
    config.to_env()
    Server(
        "mlxgate.server:create_worker_app",
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


def create_worker_app() -> Loading:
    """The app factory granian calls in its worker process. Granian's worker does not watch its
    main process: killed, that would leave the worker serving on the port, holding the model.
    So the worker ends with it (parent_watch.py)."""
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:
        parent_watch.exit_with(parent.pid)
    from mlxgate.app import create_app  # the model's modules: in the worker only

    return create_app()
