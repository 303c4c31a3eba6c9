"""`mlxgate bench --spawn NAME`: a known server started on the embedded model (SmolLM2-135M
Instruct), on a free loopback port, for the run:

- `mlxgate`: `mlxgate serve`;
- `mlxgate-plain`: `mlxgate serve --max-draft-tokens 0`, without speculative decoding (the
  baseline speculation is measured against, `--scenarios edit`);
- `mlxgate-float32`: `mlxgate serve --weights float32 --no-cpu-kernels`, as mlxgate served
  before its CPU kernels (the GGUF dequantized to float32, MLX's ops with OpenBLAS);
- `mlx_lm`: `mlx_lm.server` on the same float32 weights exported as an mlx-lm directory (made
  once, under `~/.cache/mlxgate/`), with OpenBLAS preloaded as mlxgate does it;
- `llama-server`: llama.cpp's server on the GGUF the package ships (`llama-server` on the PATH,
  or `$LLAMA_SERVER`; benches/build_llama_server.sh builds one from llama-cpp-python's sdist),
  with as many slots as the run's highest concurrency, continuous batching, and the context
  mlxgate serves the model with;
- `llama-server-8k`: the same, tuned as its users run it: the GGUF's own 8k context (no YaRN),
  256-token batches;
- `llama-server-long`: `llama-server` with one slot, which holds the whole context, for the
  long-prompt scenario (a slot holds the context split evenly, and llama-server cuts a longer
  prompt without an error).

With `gguf` (`mlxgate bench --gguf FILE`) mlxgate and llama-server serve that file instead.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from mlxgate.bench.target import Target

SERVERS = (
    "mlxgate",
    "mlxgate-plain",
    "mlxgate-float32",
    "mlxgate-int8",
    "mlx_lm",
    "llama-server",
    "llama-server-8k",
    "llama-server-long",
)
LLAMA_SERVERS = ("llama-server", "llama-server-8k", "llama-server-long")
EXPORT_DIR = Path.home() / ".cache" / "mlxgate" / "smollm2-mlx"
# What each speaks best, and the model name its requests carry.
DIALECT = {
    "mlxgate": "anthropic",
    "mlxgate-plain": "anthropic",
    "mlxgate-float32": "anthropic",
    "mlxgate-int8": "anthropic",
    "mlx_lm": "openai",
    "llama-server": "openai",
    "llama-server-8k": "openai",
    "llama-server-long": "openai",
}
MODEL = {
    "mlxgate": "SmolLM2-135M-Instruct",
    "mlxgate-plain": "SmolLM2-135M-Instruct",
    "mlxgate-float32": "SmolLM2-135M-Instruct",
    "mlxgate-int8": "SmolLM2-135M-Instruct",
    "mlx_lm": "default_model",
    "llama-server": "smollm2",
    "llama-server-8k": "smollm2",
    "llama-server-long": "smollm2",
}


def served_name(name: str, gguf: Path | None) -> str:
    """The model name requests to spawned server `name` carry: the embedded model's, or the
    file's stem."""
    return MODEL[name] if gguf is None else gguf.stem


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def mlxgate_command(port: int | str, extra: Sequence[str] = ()) -> list[str]:
    python = sys.executable
    return [python, "-m", "mlxgate", "serve", "--host", "127.0.0.1", "--port", str(port), *extra]


def mlx_lm_command(model_dir: Path, port: int | str, extra: Sequence[str] = ()) -> list[str]:
    argv = ["mlx_lm.server", "--model", str(model_dir), "--host", "127.0.0.1"]
    argv += ["--port", str(port), *extra]
    # OpenBLAS must be in the process before mlx.core is imported, as mlxgate does it.
    code = (
        "import mlxgate.blas as b; b.preload_openblas(); import runpy, sys; "
        f"sys.argv = {argv!r}; runpy.run_module('mlx_lm.server', run_name='__main__')"
    )
    return [sys.executable, "-c", code]


def command(name: str, port: int, slots: int, gguf: Path | None = None) -> list[str]:
    """The command line that serves the embedded model (or the file `gguf`) as `name` on
    `port`."""
    model = [] if gguf is None else ["--model", str(gguf)]
    if name == "mlxgate":
        return mlxgate_command(port, model)
    if name == "mlxgate-plain":
        return mlxgate_command(port, [*model, "--max-draft-tokens", "0"])
    if name == "mlxgate-float32":
        return mlxgate_command(port, [*model, "--weights", "float32", "--no-cpu-kernels"])
    if name == "mlxgate-int8":
        return mlxgate_command(port, [*model, "--int8-activations"])
    if name == "mlx_lm":
        if gguf is not None:
            raise ValueError("mlx_lm serves the embedded model's export only (not a --gguf)")
        from mlxgate.models.export import export

        return mlx_lm_command(export(EXPORT_DIR), port)
    if name in LLAMA_SERVERS:
        return llama_server_command(name, port, slots, gguf)
    raise ValueError(f"unknown server {name!r} (one of {', '.join(SERVERS)})")


def llama_server_command(name: str, port: int, slots: int, gguf: Path | None) -> list[str]:
    from mlxgate.models import DEFAULT_MODEL_CONTEXT, default_model_path

    binary = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if binary is None:
        raise FileNotFoundError(
            "no llama-server on the PATH (or in $LLAMA_SERVER): "
            "benches/build_llama_server.sh builds one"
        )
    # The model's own chat template (`--jinja`: tools need it, and llama-server's built-in
    # chatml drops the default system prompt). Not `--kv-unified`: in the llama.cpp
    # build_llama_server.sh builds it does not enlarge a slot, and every step attends over all
    # the cells (C=32: 51 tok/s with it, 89 without, issue 50). A slot holds the context split
    # evenly, and llama-server cuts a longer prompt without an error: the report's prompt tokens
    # show it.
    if name == "llama-server-long":
        slots = 1
    common = [
        binary, "--model", str(gguf or default_model_path()), "--host", "127.0.0.1",
        "--port", str(port), "--alias", served_name(name, gguf), "--jinja",
        "--parallel", str(slots), "--cont-batching", "--threads", str(os.cpu_count() or 1),
    ]  # fmt: skip
    if name == "llama-server-8k":
        return [*common, "--ctx-size", str(max(8192, 2048 * slots)), "-b", "256", "-ub", "256"]
    # The context mlxgate serves the model with: the embedded model's YaRN x4 on its 8,192, a
    # file's own.
    if gguf is None:
        context = DEFAULT_MODEL_CONTEXT
        rope = ["--rope-scaling", "yarn", "--rope-scale", str(context // 8192)]
        rope += ["--yarn-orig-ctx", "8192"]
    else:
        context, rope = own_context(gguf), []
    return [*common, "--ctx-size", str(max(context, 2048 * slots)), *rope]


def own_context(gguf: Path) -> int:
    """The context a GGUF file says its model was trained for."""
    from mlxgate.models.gguf import read_metadata

    meta = read_metadata(gguf)
    return int(meta[f"{meta['general.architecture']}.context_length"])


@dataclass(eq=False)  # identity: a started server is tracked in a set
class Server:
    """A server process in a session of its own (so that stopping it stops its workers too),
    its output in `log_path`. The tests start theirs with it too (tests/support/servers.py)."""

    name: str
    command: list[str]
    port: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    cwd: Path | None = None
    env: Mapping[str, str] | None = None  # the whole environment (None: this process's)
    tracked: bool = True  # in RUNNING while it runs, for `stop_all` (the tests keep their own)
    model: str | None = None  # the model name its requests carry (None: MODEL[name])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def target(self) -> Target:
        dialect = DIALECT[self.name]
        # A server that speaks only chat completions gets an agent trace's turns as such.
        model = self.model or MODEL[self.name]
        return Target(self.name, self.url, dialect, self.pid, model, dialect == "openai")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def start(self, ready_timeout_s: float = 300.0, poll_s: float = 0.5) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.cwd,
                env=self.env,
                start_new_session=True,
            )
        if self.tracked:
            RUNNING.add(self)
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
                time.sleep(poll_s)
        self.stop()
        raise RuntimeError(
            f"{self.name} not ready after {ready_timeout_s:.0f} s; see {self.log_path}"
        )

    def stop(self, grace_s: float = 15.0) -> None:
        process, self.process = self.process, None
        RUNNING.discard(self)
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(5.0)


RUNNING: set[Server] = set()


def stop_all() -> None:
    """Stop every server this process started (for exit paths)."""
    for server in list(RUNNING):
        server.stop(grace_s=5.0)


def spawn(name: str, slots: int, log_dir: Path, gguf: Path | None = None) -> Server:
    """Start `name` (on the embedded model, or the file `gguf`) on a free port and wait until it
    answers /health."""
    port = free_port()
    argv = command(name, port, slots, gguf)
    server = Server(name, argv, port, log_dir / f"{name}.log", model=served_name(name, gguf))
    server.start()
    return server
