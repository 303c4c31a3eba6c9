"""Graceful shutdown: on SIGTERM or SIGINT the server stops admitting, lets running generations
finish for up to `--drain-timeout` seconds, ends the rest with the dialect's error event, and
only then lets granian stop (exit 0).

granian's worker stops serving at the first signal (its handler on the event loop); the drain
takes that handler's place while it runs and calls it when done. granian's main process waits
`--drain-timeout` plus a margin for the worker before it kills it (server.py).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable

log = logging.getLogger("mlxgate")

SIGNALS = (signal.SIGTERM, signal.SIGINT)
POLL_S = 0.05
# After the engine ended the streams left, how long their last events get to go out.
FLUSH_S = 5.0


class Drain:
    """Counts the generation requests in flight; drains them when a stop signal comes."""

    def __init__(self, timeout_s: float, stop_engine: Callable[[], None]) -> None:
        self.timeout_s = timeout_s
        self.stop_engine = stop_engine
        self.draining = False
        self.in_flight = 0
        self._stop_serving: asyncio.Handle | None = None  # granian's own handler, run at the end
        self._task: asyncio.Future[None] | None = None

    def install(self) -> None:
        """Take the place of granian's signal handlers on the running loop (at lifespan
        startup, which granian runs after installing them)."""
        loop = asyncio.get_running_loop()
        handlers = getattr(loop, "_signal_handlers", {})
        if not all(sig in handlers for sig in SIGNALS):
            log.warning("no signal handler of granian's to wrap: shutdown will not drain")
            return
        # granian sets one event for either signal: one of its handlers stops the worker.
        self._stop_serving = handlers[signal.SIGTERM]
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self._begin)

    def _begin(self) -> None:
        if self.draining:
            return  # Ctrl-C reaches the worker and granian's main process forwards a SIGTERM
        self.draining = True
        log.info(
            "stopping: %d requests in flight get up to %.0fs to finish; new ones are refused",
            self.in_flight,
            self.timeout_s,
        )
        self._task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        if self.in_flight:
            log.warning("drain timeout: ending %d requests with an error", self.in_flight)
        # Ends the streams left with "the server is shutting down" in their dialect.
        await asyncio.get_running_loop().run_in_executor(None, self.stop_engine)
        flushed = time.monotonic() + FLUSH_S
        while self.in_flight and time.monotonic() < flushed:
            await asyncio.sleep(POLL_S)
        assert self._stop_serving is not None
        self._stop_serving._run()  # the worker stops serving
