"""A run's plots, as PNG files in its run directory (matplotlib, the `bench` extra):

throughput.png   output tokens/s against concurrency, per target (the sweep)
latency.png      TTFT and inter-token latency CDFs per target, at the sweep's top level
hol.png          every running stream's inter-token gaps over time around a long prompt's
                 prefill, per target (the head-of-line scenario)
turns.png        median TTFT per turn of the agent replay, per target
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxgate.bench.records import Record

TITLES = {
    "throughput.png": "Throughput against concurrency",
    "latency.png": "TTFT and inter-token latency",
    "hol.png": "Inter-token gaps while a long prompt lands",
    "turns.png": "TTFT by turn of the agent replay",
}


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def draw(summary: dict[str, Any], records: list[Record], out: Path) -> list[str]:
    """Draw what the run has data for into `out`; the file names drawn."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    names = [t["name"] for t in summary["targets"]]
    runs = summary["runs"]
    drawn = []
    sweep = [r for r in runs if r["scenario"] == "sweep"]
    if sweep:
        _throughput(sweep, names, out / "throughput.png")
        top = max(r["concurrency"] for r in sweep)
        at_top = [r for r in records if r.scenario == "sweep" and r.concurrency == top]
        _latency(at_top, names, top, out / "latency.png")
        drawn += ["throughput.png", "latency.png"]
    hol = [r for r in runs if r["scenario"] == "hol" and "scenario_figures" in r]
    if hol:
        _hol(hol, out / "hol.png")
        drawn.append("hol.png")
    agent = [r for r in runs if r["scenario"] == "agent"]
    if agent:
        _turns(agent, out / "turns.png")
        drawn.append("turns.png")
    return drawn


def _figure(columns: int = 1) -> Any:
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, columns, figsize=(6.4 * columns, 4.2), squeeze=False)
    return figure, axes[0]


def _label(axis: Any, x: str, y: str, title: str) -> None:
    axis.set_xlabel(x)
    axis.set_ylabel(y)
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend()


def _save(figure: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _throughput(sweep: list[dict[str, Any]], names: list[str], path: Path) -> None:
    figure, (axis,) = _figure()
    for name in names:
        mine = sorted((r for r in sweep if r["target"] == name), key=lambda r: r["concurrency"])
        axis.plot(
            [r["concurrency"] for r in mine],
            [r["output_tok_s"] for r in mine],
            marker="o",
            label=name,
        )
    axis.set_xscale("log", base=2)
    _label(axis, "concurrent clients", "output tokens/s (all streams)", TITLES[path.name])
    _save(figure, path)


def _cdf(axis: Any, values: list[float], label: str) -> None:
    ordered = sorted(values)
    if ordered:
        axis.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)


def _latency(records: list[Record], names: list[str], level: int, path: Path) -> None:
    figure, (ttft, itl) = _figure(2)
    for name in names:
        mine = [r for r in records if r.target == name and r.ok]
        _cdf(ttft, [1000 * r.ttft_s for r in mine if r.ttft_s is not None], name)
        _cdf(itl, [1000 * g for r in mine for g in r.gaps], name)
    _label(ttft, "time to first token (ms)", "share of requests", f"TTFT, C={level}")
    _label(itl, "inter-token latency (ms)", "share of gaps", f"inter-token latency, C={level}")
    _save(figure, path)


def _hol(runs: list[dict[str, Any]], path: Path) -> None:
    figure, axes = _figure(len(runs))
    for axis, run in zip(axes, runs, strict=True):
        figures = run["scenario_figures"]
        start, end = figures["window_s"]
        axis.axvspan(start, end, color="orange", alpha=0.2, label="long prompt's prefill")
        points = figures["gaps_over_time"]
        axis.scatter([t for t, _ in points], [1000 * g for _, g in points], s=6)
        x, title = "seconds from the long prompt's send", f"{run['target']}: inter-token gaps"
        _label(axis, x, "inter-token gap (ms)", title)
    _save(figure, path)


def _turns(runs: list[dict[str, Any]], path: Path) -> None:
    figure, (axis,) = _figure()
    for run in runs:
        ttfts = run["turn_ttft_s_p50"]
        turns = [i for i, t in enumerate(ttfts) if t is not None]
        axis.plot(turns, [1000 * ttfts[i] for i in turns], marker="o", label=run["target"])
    _label(axis, "turn", "TTFT p50 (ms)", TITLES[path.name])
    _save(figure, path)
