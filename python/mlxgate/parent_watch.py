"""Ending with the parent: a process mlxgate starts (granian's worker, each rank of `--ranks N`)
exits the moment the process that started it dies, however it died.

A parent killed with SIGKILL (by hand, or by the out-of-memory killer) runs no code on its way
out, so each child watches for itself. On Linux the kernel does it: `prctl(PR_SET_PDEATHSIG,
SIGKILL)` kills the child when the thread that started it exits (mlxgate's children are started
by their parent's main thread, which lives as long as the process). Elsewhere (macOS) a thread
polls `getppid()`: a child whose parent died has been handed to another process (launchd, init).
Both then check that the parent is still the one expected: it may have died before the child
started watching.

The child ends at once and writes nothing on its way out. What it leaves on disk stays sound:
the prefix cache's disk tier writes each file under a temporary name and renames it into place
(a file is whole or absent; a temporary file left behind is deleted at the next start), and a
file damaged any other way fails its checksum on reading and is deleted.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_S = 0.25
EXIT_ORPHANED = 1


def exit_with(parent_pid: int) -> None:
    """End this process when `parent_pid`, its parent, dies; at once if it already has."""
    if not _killed_by_kernel():
        watch(parent_pid)
    if os.getppid() != parent_pid:
        os._exit(EXIT_ORPHANED)


def watch(parent_pid: int, poll_s: float = POLL_S) -> None:
    """The portable way: a thread that ends the process once its parent is no longer
    `parent_pid` (checked every `poll_s`)."""

    def run() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(EXIT_ORPHANED)

    threading.Thread(target=run, name="mlxgate-parent-watch", daemon=True).start()


def _killed_by_kernel() -> bool:
    """Linux: have the kernel SIGKILL this process when its parent exits. False elsewhere, or
    if the call is refused."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        args = (ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0), ctypes.c_ulong(0))
        return int(libc.prctl(ctypes.c_int(PR_SET_PDEATHSIG), *args, ctypes.c_ulong(0))) == 0
    except (OSError, AttributeError):
        return False
