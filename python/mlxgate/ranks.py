"""One model across processes: MLX's distributed backend, mlx-lm's sharding, mlxgate's ranks.

`mlxgate serve` started by `mlx.launch` (one process per host, or `--ranks N` on this machine)
finds its rank in the group MLX's launcher describes (ring over TCP, JACCL over RDMA, MPI).
Every rank loads its shard of the model: tensor parallel by default (mlx-lm's `shard()`: each
rank holds a slice of every layer's heads and MLP, and the layers sum their parts with
`all_sum`), or pipeline parallel with `--pipeline` (mlx-lm's `pipeline()`: each rank holds a
run of layers and hands its hidden states on). Rank 0 serves HTTP and runs the engine; the
other ranks run the same engine in lockstep (engine/lockstep.py), told every decision.

A rank that dies or stops answering fails the group: rank 0 answers /health with 503, ends
every stream with an error event and exits non-zero; the others exit too. A dead peer shows as
an error in the next collective; a stalled one as silence: a watchdog per rank fails the group
once the others have not answered for `--rank-timeout` seconds (the engine shares something
at least every second, idle or not, and a few times a pass while prefilling; rank 0's own work
between shares does not count).

The ranks `--ranks N` starts end with their launcher, killed or not (parent_watch.py), and rank
0's granian worker ends with rank 0.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn

    from mlxgate.config import Config
    from mlxgate.engine.engine import Engine
    from mlxgate.engine.lockstep import RankGroup

log = logging.getLogger("mlxgate.ranks")

# What MLX's launchers set in each process they start (ring, JACCL, MPI).
LAUNCHED = ("MLX_HOSTFILE", "MLX_JACCL_COORDINATOR", "OMPI_COMM_WORLD_SIZE")
# Seconds a failing rank 0 keeps answering (health 503, error events) before it exits.
FAIL_GRACE_S = 2.0
EXIT_FAILED = 3
# How much longer than --rank-timeout the other ranks wait for rank 0 (see `watch`).
FOLLOWER_PATIENCE = 12
FOLLOWER_MIN_S = 60.0
# `--ranks N`: seconds the other ranks get to end on their own once one has.
STOP_AFTER_S = 5.0
# `--ranks N`: the launcher's pid, in each rank it starts (which ends when the launcher does).
LAUNCHER_PID = "MLXGATE_LAUNCHER_PID"
# `--ranks N`: the directory where each rank says it is about to join (see `wait_for_peers`).
READY_DIR = "MLXGATE_RANKS_READY_DIR"
READY_POLL_S = 0.05


# Why this rank's group failed, once it has (rank 0's /health says it).
failure: str | None = None


def launched() -> bool:
    """Whether this process is one rank of a group MLX's launcher started."""
    return any(os.environ.get(name) for name in LAUNCHED)


def rank_of_process() -> int:
    """This process's rank, as the launcher set it (before the group is joined)."""
    for name in ("MLX_RANK", "OMPI_COMM_WORLD_RANK"):
        if value := os.environ.get(name):
            return int(value)
    return 0


def end_with_launcher() -> None:
    """A rank `--ranks N` started ends the moment its launcher does (the rest of the group would
    otherwise serve on, or wait for a rank 0 that is gone)."""
    if pid := os.environ.pop(LAUNCHER_PID, None):
        from mlxgate import parent_watch

        parent_watch.exit_with(int(pid))


def group() -> mx.distributed.Group | None:
    """This process's group, when launched as one of several ranks (else None)."""
    if not launched():
        return None
    import mlx.core as mx

    wait_for_peers()
    joined = mx.distributed.init(strict=True)
    return joined if joined.size() > 1 else None


def wait_for_peers() -> None:
    """With `--ranks N`, join only once every rank is ready to. MLX's ring gives the last rank
    15 s to find rank 0 listening, and the others as long to find the next: a rank that starts
    slowly (rank 0 starts granian first; a busy machine) would fail the group before it formed.
    Each rank leaves a file in the launcher's directory and waits for all N; a rank that dies
    first ends the launch (`launch_local`), and with it this one."""
    directory = os.environ.get(READY_DIR)
    if not directory:
        return
    with open(os.environ["MLX_HOSTFILE"]) as hostfile:
        size = len(json.load(hostfile))
    open(os.path.join(directory, f"rank-{rank_of_process()}"), "w").close()
    while len(os.listdir(directory)) < size:
        time.sleep(READY_POLL_S)


def check_config(config: Config) -> None:
    """What a sharded model cannot serve, refused before anything loads."""
    problems = []
    if len(config.model) > 1 or config.models_config:
        problems.append("one model (not several --model, nor --models-config)")
    if config.engine.prefix_cache_dir:
        problems.append("no --prefix-cache-dir (each rank would need its own shard's files)")
    if problems:
        raise ValueError("across ranks mlxgate serves " + "; ".join(problems))


def sharder(mlx_group: mx.distributed.Group, pipeline: bool) -> Callable[[nn.Module], None]:
    """Cuts a lazily loaded model to this rank's shard, before its weights are read."""

    def shard(model: nn.Module) -> None:
        size = mlx_group.size()
        kind = getattr(model, "model_type", type(model).__module__.rsplit(".")[-1])
        if pipeline:
            inner: Any = getattr(model, "model", None)
            if not hasattr(inner, "pipeline"):
                raise ValueError(
                    f"--pipeline: mlx-lm's {kind} model cannot be pipelined (no pipeline()); "
                    "serve it tensor parallel (without --pipeline)"
                )
            if len(inner.layers) < size:
                raise ValueError(f"{len(inner.layers)} layers cannot go over {size} ranks")
            inner.pipeline(mlx_group)
            return
        if not hasattr(model, "shard"):
            raise ValueError(
                f"mlx-lm's {kind} model cannot be sharded tensor parallel (no shard())"
                + ("; try --pipeline" if hasattr(getattr(model, "model", None), "pipeline") else "")
            )
        if uneven := _uneven_heads(model, size):
            raise ValueError(
                f"{uneven} do not divide over {size} ranks: tensor parallel splits them; "
                f"choose a number of ranks that divides them"
                + (", or --pipeline" if hasattr(getattr(model, "model", None), "pipeline") else "")
            )
        try:
            model.shard(mlx_group)
        except ValueError as exc:
            raise ValueError(f"tensor parallel cannot cut it over {size} ranks: {exc}") from exc
        return

    return shard


def _uneven_heads(model: nn.Module, ranks: int) -> str:
    """The model's head counts that `ranks` does not divide, in words ('' if none)."""
    args = getattr(model, "args", None)
    counts = {
        "attention heads": getattr(args, "num_attention_heads", None),
        "key/value heads": getattr(args, "num_key_value_heads", None),
    }
    uneven = [f"its {n} {what}" for what, n in counts.items() if isinstance(n, int) and n % ranks]
    return " and ".join(uneven)


class SilentRouter:
    """The router of a rank other than 0: streams live on rank 0; rank 0 tells it what the real
    router says (engine/lockstep.py), so what the engine tells the router goes nowhere here."""

    def __len__(self) -> int:
        return 0

    def ping(self, stream_id: int) -> None: ...

    def cached(self, stream_id: int, cached_tokens: int, cached_from: str) -> None: ...

    def logprobs(self, sampled: Any) -> None: ...

    def fail(self, stream_id: int, kind: Any, message: str) -> None: ...


def watch(lockstep: RankGroup, timeout_s: float) -> None:
    """Fail the group once the other ranks have not answered for `timeout_s` (a thread per
    rank). Rank 0's own decisions do not count: a grammar's first compile or a draft model's
    prefill may take long. So the other ranks, which wait for those, wait FOLLOWER_PATIENCE
    times longer (at least FOLLOWER_MIN_S) before they give up on rank 0."""
    if not lockstep.leader:
        timeout_s = max(FOLLOWER_MIN_S, FOLLOWER_PATIENCE * timeout_s)

    def run() -> None:
        while True:
            time.sleep(min(0.25, timeout_s / 4))
            if lockstep.stopped:
                return
            silent = time.monotonic() - lockstep.alive_at
            if silent > timeout_s and not lockstep.deciding:
                lockstep.failed(
                    f"no word from the other ranks for {silent:.1f}s (the limit: "
                    f"{timeout_s:g}s): a rank died or stalled"
                )
                return

    threading.Thread(target=run, name="mlxgate-rank-watchdog", daemon=True).start()


def exit_failed(message: str, grace_s: float = 0.0) -> None:
    """Leave the process now (after `grace_s`): a failed group cannot be recovered in place, and
    the engine's thread may be blocked in a collective that never returns."""

    def leave() -> None:
        time.sleep(grace_s)
        log.error("exiting: %s", message)
        logging.shutdown()
        os._exit(EXIT_FAILED)

    threading.Thread(target=leave, name="mlxgate-rank-exit", daemon=True).start()


def leader_failed(engine: Engine, message: str) -> None:
    """Rank 0's group failed: /health answers 503, every stream ends with an error event, and
    the process exits non-zero once those have had FAIL_GRACE_S to go out."""
    global failure
    if failure is not None:
        return
    failure = message
    log.error("the ranks' group failed: %s", message)
    engine.abandon(f"the server failed: {message}")
    exit_failed(message, FAIL_GRACE_S)


def launch_local(ranks: int, argv: list[str], rank_timeout: float) -> int:
    """`mlxgate serve --ranks N`: N ranks of this command on this machine, over the ring backend
    on loopback, started as `mlx.launch --backend ring -n N` starts them (its hostfile and
    MLX_RANK), each computing on its N-th of the cores, each ending with this process. Once one
    ends (rank 0, or another with an error), the rest get STOP_AFTER_S to end on their own, on
    top of the time rank 0's watchdog takes to fail the group and tell its clients
    (`rank_timeout` + FAIL_GRACE_S), then are stopped. Returns the first exit code that is not 0
    (mlx.launch itself exits 0 whatever its ranks did).
    """
    ports = _free_ports(ranks)
    shared = tempfile.mkdtemp(prefix="mlxgate-ranks-")
    hostfile = os.path.join(shared, "hosts.json")
    with open(hostfile, "w") as f:
        json.dump([[f"127.0.0.1:{port}"] for port in ports], f)
    ready = os.path.join(shared, "ready")
    os.mkdir(ready)
    command = [sys.executable, "-m", "mlxgate", *argv]
    # The ranks share this machine's cores: each computes on its share of them.
    threads = str(max(1, (os.cpu_count() or 1) // ranks))
    env = {"MLXGATE_KERNEL_THREADS": threads, "OPENBLAS_NUM_THREADS": threads, **os.environ}
    env.update({LAUNCHER_PID: str(os.getpid()), "MLX_HOSTFILE": hostfile, READY_DIR: ready})
    processes = [
        subprocess.Popen(command, env={**env, "MLX_RANK": str(rank)}) for rank in range(ranks)
    ]

    def forward(signum: int, frame: Any) -> None:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    ended_at: float | None = None
    # (Stopped sooner, rank 0 would die before its clients hear that the group failed.)
    patience_s = rank_timeout + FAIL_GRACE_S + STOP_AFTER_S
    try:
        while any(process.poll() is None for process in processes):
            time.sleep(0.1)
            codes = [process.poll() for process in processes]
            if ended_at is None and (codes[0] is not None or any(codes)):
                ended_at = time.monotonic()
            if ended_at is not None and time.monotonic() - ended_at > patience_s:
                for process in processes:
                    if process.poll() is None:
                        process.kill()
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    for rank, process in enumerate(processes):
        if process.returncode:
            print(f"mlxgate: rank {rank} exited with {process.returncode}", file=sys.stderr)
    return next((process.returncode for process in processes if process.returncode), 0)


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports
