"""What a benchmark reads of the machine: its CPU, a server's CPU time from /proc (its whole
process tree: granian runs the app in a worker) and the load average around a run."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


# The instruction sets the kernels (and llama.cpp) choose between, as /proc/cpuinfo names them.
VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni")


def cpu_described() -> str:
    """The CPU's model and its vector instruction sets, e.g. "AMD EPYC 7B13 (avx2 fma f16c)",
    and whether mlxgate was told to keep off AVX-512 (MLXGATE_NO_AVX512)."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    described = f"{model} ({' '.join(f for f in VECTOR_FLAGS if f in flags) or 'no AVX2'})"
    if os.environ.get("MLXGATE_NO_AVX512"):
        described += ", MLXGATE_NO_AVX512 set"
    return described


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


def blas(root: int) -> str:
    """Which BLAS the process tree under `root` has mapped (checked, not assumed)."""
    for pid in process_tree(root):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        if "libopenblas" in maps:
            return "OpenBLAS"
    return "reference BLAS (no libopenblas mapped)"


def load_average() -> float:
    """The machine's 1-minute load average (what else was running)."""
    return os.getloadavg()[0]


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
