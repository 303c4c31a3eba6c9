"""How the benchmarks publish a result: printed, and written to `OUT/NAME-YYYYmmdd-HHMMSS.md`
(OUT is benches/results unless `--out` says otherwise); and how they log their progress."""

from __future__ import annotations

import sys
import time
from pathlib import Path


def log(message: str) -> None:
    """A progress line on stderr, with the time."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def publish(lines: list[str], out: Path, name: str) -> Path:
    report = "\n".join(lines) + "\n"
    print(report)
    out.mkdir(exist_ok=True)
    path = out / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.md"
    path.write_text(report)
    print(f"wrote {path}")
    return path
