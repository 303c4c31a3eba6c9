"""Every process mlxgate starts ends with the process that started it (parent_watch.py): a
`mlxgate serve` killed with SIGKILL leaves no worker serving on its port, nor does a killed
`--ranks 2` launch leave its ranks; a restart on the same port answers as before the kill."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
from test_ranks import QWEN3_VOCAB

from mlxgate.engine.disk_cache import BLOCK_TOKENS, SUFFIX
from support import tiny_models
from support.servers import STARTED, RunningServer, metric, start_server

# A process tree must be gone within this long after its root is killed.
GONE_S = 5.0

CHILD = """
import sys, time
from mlxgate import parent_watch
how, parent = sys.argv[1], int(sys.argv[2])
if how == "kernel":
    parent_watch.exit_with(parent)
else:
    parent_watch.watch(parent, poll_s=0.05)
print("watching", flush=True)
time.sleep(60)
"""
PARENT = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], str(os.getpid())])
print(child.pid, flush=True)
time.sleep(60)
"""


def group(pgid: int) -> set[int]:
    """The live processes of process group `pgid` (a server's: it starts a session of its own,
    and nothing under it leaves the group)."""
    listed = subprocess.run(
        ["ps", "-A", "-o", "pid=", "-o", "pgid=", "-o", "stat="],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [line.split() for line in listed.splitlines()]
    return {int(pid) for pid, gid, stat in rows if int(gid) == pgid and not stat.startswith("Z")}


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError:
            return False
    return True


def assert_all_gone(pgid: int, port: int | None, since: float, what: str) -> None:
    """Within GONE_S of `since`, no process of the group is left and `port` can be bound."""
    while (left := group(pgid)) or (port is not None and not port_free(port)):
        if time.monotonic() - since > GONE_S:
            left_over = ", ".join(_described(pid) for pid in left) or "none"
            raise AssertionError(f"{GONE_S:g} s after {what}: processes left: {left_over}")
        time.sleep(0.05)


def _described(pid: int) -> str:
    args = subprocess.run(
        ["ps", "-ww", "-o", "args=", "-p", str(pid)], capture_output=True, text=True
    )
    return f"{pid} ({args.stdout.strip()})"


def killed(server: RunningServer, processes: int) -> None:
    """SIGKILL to `mlxgate serve` alone: the rest of its `processes` end by themselves."""
    assert server.process is not None
    pgid = server.pid
    assert len(group(pgid)) == processes, [_described(pid) for pid in group(pgid)]
    os.kill(server.pid, signal.SIGKILL)
    since = time.monotonic()
    server.process.wait(GONE_S)
    assert_all_gone(pgid, server.port, since, "SIGKILL")


def terminated(server: RunningServer) -> None:
    """SIGTERM to `mlxgate serve` alone: it drains and exits 0, and the rest end with it."""
    assert server.process is not None
    pgid = server.pid
    os.kill(server.pid, signal.SIGTERM)
    assert server.process.wait(30) == 0
    assert_all_gone(pgid, server.port, time.monotonic(), "SIGTERM's exit")


def restarted(server: RunningServer, tmp: Path) -> RunningServer:
    """The same command line (the same port) started again."""
    again = dataclasses.replace(server, log_path=tmp / f"restarted-{server.port}.log", process=None)
    STARTED.append(again)
    try:
        again.start(180, poll_s=0.2)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}:\n{again.log()}") from None
    return again


@contextlib.contextmanager
def no_leftovers(server: RunningServer) -> Iterator[None]:
    """Whatever happens, nothing of the server's group outlives the test."""
    pgid = server.pid
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        if server.process is not None:
            server.process.wait(GONE_S)


def ask(server: RunningServer, messages: list[dict[str, str]]) -> dict[str, Any]:
    request = {"model": "m", "messages": messages, "max_tokens": 8, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=request, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["kernel", "thread"])
def test_a_child_ends_when_its_parent_is_killed(how: str) -> None:
    """Linux's PR_SET_PDEATHSIG, and the thread that polls getppid() (macOS's way)."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD, how],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert parent.stdout is not None
    try:
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "watching"
        assert group(parent.pid) == {parent.pid, child}
        parent.kill()
        since = time.monotonic()
        parent.wait(GONE_S)
        assert_all_gone(parent.pid, None, since, "the parent's SIGKILL")
        assert time.monotonic() - since < 2.0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(GONE_S)


@pytest.mark.parametrize("how", ["exit_with", "watch"])
def test_a_child_whose_parent_died_before_it_watched_ends_at_once(how: str) -> None:
    """Its parent is not the one it was told (as when that one died and it was handed over)."""
    code = f"import time; from mlxgate import parent_watch; parent_watch.{how}(1); "
    code += "time.sleep(1); print('alive')"
    ended = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert ended.returncode == 1 and "alive" not in ended.stdout


@pytest.mark.slow
def test_a_killed_server_leaves_nothing_and_its_restart_reads_the_disk(tmp_path: Path) -> None:
    """The embedded model with a prefix cache directory: after SIGKILL the worker is gone too,
    and a restart on the same port and directory answers the same, its prefix read from disk
    (and a temporary file a killed writer left is deleted, never read)."""
    system = " ".join(f"Rule {i}: answer in plain words, briefly." for i in range(25))
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    directory = str(tmp_path / "prefixes")
    server = start_server(tmp_path, "--prefix-cache-dir", directory)
    with no_leftovers(server):
        before = ask(server, messages)
        blocks = (before["usage"]["prompt_tokens"] - 1) // BLOCK_TOKENS
        assert blocks >= 1
        deadline = time.monotonic() + 30
        while metric(server, "mlxgate_prefix_cache_disk_written_files_total") < blocks:
            assert time.monotonic() < deadline, "the prompt's blocks were written"
            time.sleep(0.1)
        killed(server, processes=2)  # granian's main process and its worker
    # What a worker killed mid-write leaves: half a file under its temporary name.
    block = next(Path(directory).glob(f"*/*{SUFFIX}"))
    half = block.with_name(f".{block.name.removesuffix(SUFFIX)}.99999.tmp")
    half.write_bytes(block.read_bytes()[: block.stat().st_size // 2])
    again = restarted(server, tmp_path)
    with no_leftovers(again):
        after = ask(again, messages)
        assert after["choices"] == before["choices"]
        cached = after["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == blocks * BLOCK_TOKENS
        assert metric(again, "mlxgate_prefix_cache_hit_tokens_total", tier="disk") == cached
        deadline = time.monotonic() + 10  # (the disk writer's first job)
        while half.exists():
            assert time.monotonic() < deadline, "the start deleted the temporary file"
            time.sleep(0.05)
        terminated(again)


@pytest.mark.slow
def test_a_killed_launch_of_two_ranks_leaves_nothing(tmp_path: Path) -> None:
    """`--ranks 2`: the launcher killed, both ranks and rank 0's granian worker end; a restart
    on the same port answers the same."""
    model = tiny_models.directory(tmp_path, "llama", vocab_size=QWEN3_VOCAB)
    messages = [{"role": "user", "content": "Name three colours."}]
    server = start_server(tmp_path, "--model", str(model), "--ranks", "2", timeout_s=180)
    with no_leftovers(server):
        before = ask(server, messages)
        killed(server, processes=4)  # the launcher, rank 0 and its worker, rank 1
    again = restarted(server, tmp_path)
    with no_leftovers(again):
        after = ask(again, messages)
        assert after["choices"] == before["choices"]
        assert after["usage"] == before["usage"]
        terminated(again)
