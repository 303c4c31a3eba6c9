"""mlxgate's real app under granian, on an engine that replays tokens as fast as it can (no model).

    .venv/bin/python benches/fake_engine_app.py --router rust|python --port 8090 [--gate 1000]

`--router rust` runs mlxgate's Router; `python` the pure-Python path in pure_python_stream.py.
Everything else (granian, the ASGI app, request parsing and prompt rendering, the readers'
asyncio side in mlxgate.api.reader) is the product's own code. `--gate N` holds the first streams
until N are open, so the clients measure N concurrent streams rather than a ramp.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import threading
import time
from pathlib import Path
from typing import cast

import numpy as np
from granian.constants import HTTPModes, Interfaces
from granian.log import LogLevels
from granian.server import Server
from pure_python_stream import PyRouter, mlx_lm_tokenizer
from stream_server import IDLE_FROM, STEPPING_FROM
from stream_workload import Workload, load_workload

from mlxgate import prompts
from mlxgate._native import ErrorKind, Reader, Router
from mlxgate.app import App
from mlxgate.config import Config
from mlxgate.engine import EngineStopped, GenerationRequest, PromptTooLong
from mlxgate.registry import ModelRegistry
from mlxgate.served import ServedModel

ROUTER_ENV = "STREAM_BENCH_ROUTER"
GATE_ENV = "STREAM_BENCH_GATE"
GATE_TIMEOUT_S = 30.0  # open the gate anyway if some client never arrives
SHUTTING_DOWN = "the server is shutting down"


class FakeEngine:
    """A `mlxgate.engine.GenerationEngine` standing in for mlxgate's Engine: admits every
    request and steps all open streams back to back, each replaying the workload text from its
    own place. The router ends each stream (at max_tokens: the text holds no end-of-turn
    token)."""

    def __init__(self, workload: Workload, router: Router, gate: int = 1) -> None:
        self.workload = workload
        self.context_length = workload.loaded.context_length
        self.router = router
        self.gate = gate
        self.steps = 0
        self._incoming: list[int] = []  # stream ids
        self._first_incoming_at = 0.0
        self._ids = itertools.count(1)
        self._wakeup = threading.Condition()
        self._running = threading.Event()
        self._thread: threading.Thread | None = None

    def admit(self, request: GenerationRequest) -> Reader:
        """As Engine.admit: open the request's stream and queue it."""
        if not self._running.is_set():
            raise EngineStopped()
        prompt_tokens = len(request.prompt_ids)
        context = self.context_length
        if prompt_tokens >= context:
            raise PromptTooLong(prompt_tokens, context)
        stream_id = next(self._ids)
        reader = self.router.open(
            stream_id,
            request.stream,
            prompt_tokens=prompt_tokens,
            max_tokens=min(request.max_tokens or context, context - prompt_tokens),
        )
        with self._wakeup:
            if not self._incoming:
                self._first_incoming_at = time.monotonic()
            self._incoming.append(stream_id)
            self._wakeup.notify()
        return reader

    def start(self) -> None:
        self._running.set()
        self._thread = threading.Thread(target=self._run, name="fake-engine", daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        return len(self.router) > 0

    def stop(self) -> None:
        self._running.clear()
        with self._wakeup:
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(5.0)

    def _admit(self, stepping: bool) -> list[int]:
        """New streams; while nothing is stepping, wait until the gate's count has arrived."""
        with self._wakeup:
            while self._running.is_set() and not stepping:
                waited = time.monotonic() - self._first_incoming_at
                if len(self._incoming) >= self.gate or (self._incoming and waited > GATE_TIMEOUT_S):
                    break
                self._wakeup.wait(0.05)
            if not self._running.is_set():
                return []  # stopping: _run fails them
            admitted, self._incoming = self._incoming, []
            return admitted

    def _run(self) -> None:
        stream_ids = np.empty(0, dtype=np.uint32)
        positions = np.empty(0, dtype=np.int64)
        newest = 0  # ids are taken in in order: a reported id above this one is still incoming
        early: set[int] = set()  # cancelled while incoming: the next _admit has them
        while self._running.is_set():
            admitted = self._admit(stepping=len(stream_ids) > 0)
            if early:
                admitted = [stream_id for stream_id in admitted if stream_id not in early]
                early.clear()
            if admitted:
                if not len(stream_ids):
                    print(f"{STEPPING_FROM} {time.monotonic():.6f}", flush=True)
                newest = admitted[-1]
                new_ids = np.array(admitted, dtype=np.uint32)
                stream_ids = np.concatenate([stream_ids, new_ids])
                positions = np.concatenate([positions, new_ids.astype(np.int64) * 37])
            if not len(stream_ids):
                continue
            ended = self.router.step(stream_ids, self.workload.tokens_at(positions))
            positions += 1
            self.steps += 1
            if ended:
                ids = [stream_id for stream_id, _ in ended]
                early.update(stream_id for stream_id in ids if stream_id > newest)
                keep = ~np.isin(stream_ids, ids)
                stream_ids, positions = stream_ids[keep], positions[keep]
                if not len(stream_ids):
                    print(f"{IDLE_FROM} {time.monotonic():.6f} {self.steps}", flush=True)
        with self._wakeup:
            waiting, self._incoming = self._incoming, []
        for stream_id in [*stream_ids.tolist(), *waiting]:
            self.router.fail(stream_id, ErrorKind.UNAVAILABLE, SHUTTING_DOWN)


def create_app() -> App:
    """The factory granian calls in its worker process; as mlxgate.app.build_app builds it."""
    logging.basicConfig(level=logging.WARNING)
    workload = load_workload()
    if os.environ[ROUTER_ENV] == "rust":
        router = Router(workload.vocab)
    else:
        # Duck-typed: PyRouter has the interface of Router (and PyReader that of Reader).
        router = cast(Router, PyRouter(mlx_lm_tokenizer(workload.loaded.tokenizer)))
    engine = FakeEngine(workload, router, gate=int(os.environ.get(GATE_ENV, "1")))
    engine.start()
    renderer = prompts.Renderer(workload.loaded.tokenizer)
    # ServedModel takes a GenerationEngine: mypy checks FakeEngine against the protocol here.
    served = ServedModel(workload.loaded.name, engine, renderer, workload.loaded.context_length)
    return App(ModelRegistry.serving(served), Config.from_env())


def serve(router: str, port: int, gate: int) -> None:
    os.environ[ROUTER_ENV] = router
    os.environ[GATE_ENV] = str(gate)
    # As mlxgate.server runs the app, with room in the backlog for every client at once.
    Server(
        "fake_engine_app:create_app",
        factory=True,
        working_dir=Path(__file__).resolve().parent,
        address="127.0.0.1",
        port=port,
        interface=Interfaces.ASGI,
        workers=1,
        http=HTTPModes.http1,
        backlog=4096,
        workers_kill_timeout=5,
        log_level=LogLevels.warning,
    ).serve()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--router", choices=["rust", "python"], required=True)
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--gate", type=int, default=1, help="streams to wait for before step 1")
    args = parser.parse_args()
    serve(args.router, args.port, args.gate)


if __name__ == "__main__":
    main()
