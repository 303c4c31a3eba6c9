"""How the in-process benchmarks publish a result: printed, and written to
`OUT/NAME-YYYYmmdd-HHMMSS.md` (OUT is benches/results unless `--out` says otherwise)."""

from __future__ import annotations

import time
from pathlib import Path


def publish(lines: list[str], out: Path, name: str) -> Path:
    report = "\n".join(lines) + "\n"
    print(report)
    out.mkdir(exist_ok=True)
    path = out / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.md"
    path.write_text(report)
    print(f"wrote {path}")
    return path
