"""Graceful shutdown: on SIGTERM or SIGINT the server stops admitting, lets running generations
finish for up to `--drain-timeout` seconds, ends the rest with the dialect's error event, and
only then ends the worker (exit 0).

granian's worker would stop serving at the first signal (its handler on the event loop): the
drain takes the signals over at lifespan startup, so that new requests still get their 503.
Once drained, nothing is left to serve: the worker ends with SystemExit(0), which asyncio lets
through granian's loop. granian's main process waits `--drain-timeout` plus a margin for the
worker before it kills it (server.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Iterator

log = logging.getLogger("mlxgate")

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# After the engine ended the streams left, how long their last events get to go out.
FLUSH_S = 5.0
# Once every request ended: time for granian to write out their last bytes.
LINGER_S = 0.2


class Drain:
    """Tracks the generation requests in flight; drains them when a stop signal comes."""

    def __init__(self, timeout_s: float, stop_engine: Callable[[], None]) -> None:
        self.timeout_s = timeout_s
        self.stop_engine = stop_engine
        self.draining = False
        self._running: set[asyncio.Future[None]] = set()  # one per request in flight
        self._task: asyncio.Task[None] | None = None

    @property
    def in_flight(self) -> int:
        return len(self._running)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Count the current request as in flight while it runs."""
        done = asyncio.get_running_loop().create_future()
        self._running.add(done)
        try:
            yield
        finally:
            self._running.discard(done)
            done.set_result(None)

    def install(self) -> None:
        """Take the stop signals over on the running loop (at lifespan startup, which granian
        runs after installing its own handlers)."""
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self.begin)

    def begin(self) -> None:
        if self.draining:
            return  # Ctrl-C reaches the worker and granian's main process forwards a SIGTERM
        self.draining = True
        log.info(
            "stopping: %d requests in flight get up to %.0fs to finish; new ones are refused",
            self.in_flight,
            self.timeout_s,
        )
        self._task = asyncio.get_running_loop().create_task(self._drain())

    async def settled(self) -> None:
        """Let the requests in flight finish (up to the timeout), then end the rest (the
        engine's "the server is shutting down" in their dialect)."""
        if not await self._finished(self.timeout_s):
            log.warning("drain timeout: ending %d requests with an error", self.in_flight)
        await asyncio.get_running_loop().run_in_executor(None, self.stop_engine)
        await self._finished(FLUSH_S)

    async def _finished(self, timeout_s: float) -> bool:
        """Whether the requests in flight all ended within `timeout_s`."""
        if self._running:
            await asyncio.wait(list(self._running), timeout=timeout_s)
        return not self._running

    async def _drain(self) -> None:
        await self.settled()
        await asyncio.sleep(LINGER_S)
        asyncio.get_running_loop().call_soon(_exit)


def _exit() -> None:
    """End the worker: raised in a loop callback, SystemExit leaves granian's run of the loop
    and the process exits 0."""
    raise SystemExit(0)
