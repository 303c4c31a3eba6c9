"""Starts and stops the servers under test (mlxgate, mlx_lm.server) and samples their CPU time."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from mlxgate.bench.machine import CLK_TCK, cpu_ticks, process_tree

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

# Which API dialects each server speaks, and the model name its requests carry.
# `mlxgate_plain` is mlxgate without speculative decoding, the baseline speculation is held to.
DIALECTS = {
    "mlxgate": ("anthropic", "openai"),
    "mlxgate_plain": ("anthropic", "openai"),
    "mlx_lm": ("openai",),
}
MODEL_NAMES = {
    "mlxgate": "SmolLM2-135M-Instruct",
    "mlxgate_plain": "SmolLM2-135M-Instruct",
    "mlx_lm": "default_model",
}
LABELS = {
    "mlxgate": "mlxgate",
    "mlxgate_plain": "mlxgate without speculation",
    "mlx_lm": "mlx_lm.server",
}


def display(command: list[str]) -> str:
    """A shell line for the report; the `-c` code is double-quoted (it holds no " or $)."""
    if len(command) == 3 and command[1] == "-c":
        return f'{command[0]} -c "{command[2]}"'
    return shlex.join(command)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(name: str, port: int | str, model_dir: Path, extra: list[str]) -> list[str]:
    if name == "mlxgate_plain":
        return server_command("mlxgate", port, model_dir, ["--max-draft-tokens", "0", *extra])
    if name == "mlxgate":
        return [
            PYTHON,
            "-m",
            "mlxgate",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *extra,
        ]
    if name == "mlx_lm":
        argv = ["mlx_lm.server", "--model", str(model_dir), "--host", "127.0.0.1"]
        argv += ["--port", str(port), *extra]
        # OpenBLAS must be in the process before mlx.core is imported, as mlxgate does it.
        code = (
            "import mlxgate.blas as b; b.preload_openblas(); import runpy, sys; "
            f"sys.argv = {argv!r}; runpy.run_module('mlx_lm.server', run_name='__main__')"
        )
        return [PYTHON, "-c", code]
    raise ValueError(f"unknown server {name!r} (one of {', '.join(DIALECTS)})")


@dataclass(eq=False)  # identity: a started server is tracked in a set
class Server:
    name: str
    command: list[str]
    port: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, ready_timeout_s: float = 300.0) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            # A session of its own, so stop() can signal the server and its workers together.
            self.process = subprocess.Popen(
                self.command,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        _RUNNING.add(self)
        deadline = time.monotonic() + ready_timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited with {self.process.returncode} while starting; "
                        f"see {self.log_path}"
                    )
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(
            f"{self.name} not ready after {ready_timeout_s:.0f} s; see {self.log_path}"
        )

    def stop(self, grace_s: float = 15.0) -> None:
        process, self.process = self.process, None
        _RUNNING.discard(self)
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(5.0)

    def blas(self) -> str:
        """Which BLAS the server's processes have mapped (checked, not assumed)."""
        for pid in process_tree(self.pid):
            try:
                maps = Path(f"/proc/{pid}/maps").read_text()
            except OSError:
                continue
            if "libopenblas" in maps:
                return "OpenBLAS"
        return "reference BLAS (no libopenblas mapped)"


_RUNNING: set[Server] = set()


def stop_all() -> None:
    """Stop every server this process started (for exit paths)."""
    for server in list(_RUNNING):
        server.stop(grace_s=5.0)


@dataclass
class CpuSampler:
    """Samples a process tree's CPU time every `interval_s` on a thread of its own."""

    root_pid: int
    interval_s: float = 0.05
    limit_s: float = 600.0
    samples: list[tuple[float, int]] = field(default_factory=list)  # (monotonic, ticks)

    def __post_init__(self) -> None:
        self._pids = process_tree(self.root_pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        deadline = time.monotonic() + self.limit_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            self.samples.append((time.monotonic(), cpu_ticks(self._pids)))
            self._stop.wait(self.interval_s)

    def usage(self, start: float, end: float) -> float | None:
        """Mean CPU use in cores between two monotonic times, from the samples that span it."""
        inside = [s for s in list(self.samples) if start <= s[0] <= end]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        (t0, c0), (t1, c1) = inside[0], inside[-1]
        return (c1 - c0) / CLK_TCK / (t1 - t0)

    def idle_since(
        self, after: float, window_s: float = 0.5, threshold: float = 0.05
    ) -> float | None:
        """The first sample time >= `after` that starts a `window_s` of < `threshold` cores.

        A clock tick is 10 ms, so one sample interval cannot resolve 5% of a core; a window of
        several samples can.
        """
        samples = list(self.samples)
        for i, (t_i, c_i) in enumerate(samples):
            if t_i < after:
                continue
            for t_j, c_j in samples[i + 1 :]:
                if t_j - t_i >= window_s:
                    if (c_j - c_i) / CLK_TCK / (t_j - t_i) < threshold:
                        return t_i
                    break
        return None
