"""What a benchmark reads of the machine: a server's CPU time from /proc (its whole process
tree: granian runs the app in a worker) and the load average around a run."""

from __future__ import annotations

import os
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may contain spaces and parentheses: split after the last ')'.
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree = [root]
    for pid in tree:  # grows while iterating: breadth-first
        tree.extend(child for child, parent in parents.items() if parent == pid)
    return tree


def cpu_ticks(pids: list[int]) -> int:
    """utime + stime of the given processes, in clock ticks (all their threads included)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone
        total += int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)
    return total


def cpu_seconds(root: int) -> float:
    """CPU seconds the process tree under `root` has used so far."""
    return cpu_ticks(process_tree(root)) / CLK_TCK


def rss_mb(root: int) -> float:
    """Resident memory of the process tree under `root`, MB."""
    total = 0
    for pid in process_tree(root):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass  # gone
    return total / 1024


def load_average() -> float:
    """The machine's 1-minute load average (what else was running)."""
    return os.getloadavg()[0]
