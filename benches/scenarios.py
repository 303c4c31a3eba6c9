"""The serving scenarios: what load each one sends to a running server and what it reports.
Long prompts, head-of-line, prefix reuse and disconnect are `mlxgate bench`'s own
(mlxgate/bench/scenarios.py); this script adds the sweep points and the edit case it has
always reported, and its tables."""

from __future__ import annotations

import sysconfig
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import loadgen
from loadgen import Prompt, summarize

from mlxgate.bench import scenarios as bench
from mlxgate.bench.load import story_prompt
from mlxgate.bench.records import Record
from mlxgate.bench.target import Target


@dataclass(frozen=True)
class Sizes:
    """Scenario sizes; `quick()` shrinks them for a smoke test."""

    c1: tuple[int, int] = (4, 128)  # requests, output tokens
    c8: tuple[int, int] = (16, 128)
    c32: tuple[int, int] = (64, 128)
    edit: tuple[int, int] = (5, 256)  # files, output tokens
    # The scenarios `mlxgate bench` has too (long, hol, prefix, disconnect) and the timeouts.
    shared: bench.Sizes = field(
        default_factory=lambda: bench.Sizes(long_prompts=8, prefix_tokens=4000)
    )

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            c1=(2, 32),
            c8=(8, 32),
            c32=(32, 16),
            edit=(2, 48),
            shared=replace(bench.Sizes.quick(), timeout_s=900.0, stall_s=240.0),
        )


# Scenarios ---------------------------------------------------------------------------------


async def concurrency(target: Target, sizes: Sizes, c: int) -> dict[str, Any]:
    """C clients, each request a different story prompt, `max_tokens` output tokens asked."""
    requests, max_tokens = getattr(sizes, f"c{c}")
    prompts = [story_prompt(i) for i in range(requests)]
    run = await loadgen.run_load(
        target.url,
        target.dialect,
        prompts,
        concurrency=c,
        requests=requests,
        max_tokens=max_tokens,
        model=target.model,
        timeout_s=sizes.shared.timeout_s,
        stall_s=sizes.shared.stall_s,
    )
    return {**summarize(run), "concurrency": c, "max_tokens": max_tokens}


# (standard-library file, name in it, new name): 150-250 lines each, a rename to ask for.
EDITS = (
    ("colorsys.py", "rgb_to_yiq", "rgb_to_ntsc"),
    ("genericpath.py", "getsize", "file_size"),
    ("sched.py", "enterabs", "enter_at"),
    ("fnmatch.py", "translate", "to_regex"),
    ("glob.py", "glob1", "glob_one"),
)


def edit_prompt(file: str, old: str, new: str) -> Prompt:
    """A source file and a request for it back with one small change (an agent's Edit/Write)."""
    source = (Path(sysconfig.get_paths()["stdlib"]) / file).read_text()
    return Prompt(
        f"Here is {file}:\n```python\n{source}```\nRewrite the whole file with {old} renamed "
        f"to {new}. Output the complete file only."
    )


async def edit(target: Target, sizes: Sizes) -> dict[str, Any]:
    """One client asking for source files back with a rename, one after the other."""
    files, max_tokens = sizes.edit
    prompts = [edit_prompt(*e) for e in EDITS[:files]]
    run = await loadgen.run_load(
        target.url,
        target.dialect,
        prompts,
        concurrency=1,
        requests=len(prompts),
        max_tokens=max_tokens,
        model=target.model,
        timeout_s=sizes.shared.timeout_s,
        stall_s=sizes.shared.stall_s,
    )
    return {**summarize(run), "concurrency": 1, "max_tokens": max_tokens}


async def long_prompts(target: Target, sizes: Sizes, nonce: str) -> dict[str, Any]:
    """`long_prompts` different long prompts at once: how long until each starts answering."""
    began = time.monotonic()
    outcome = await bench.long_prompts(target, sizes.shared, nonce)
    return summarize(loadgen.LoadRun(outcome.records, time.monotonic() - began))


def _failed(records: list[Record]) -> dict[str, Any]:
    return {
        "failed": sum(not r.ok for r in records),
        "errors": [r.error for r in records if r.error],
    }


async def head_of_line(target: Target, sizes: Sizes, nonce: str) -> dict[str, Any]:
    """Streams decoding while a long prompt arrives: the longest gap they see during its
    prefill (mlxgate.bench.scenarios.head_of_line)."""
    outcome = await bench.head_of_line(target, sizes.shared, nonce)
    figures = {k: v for k, v in outcome.figures.items() if k not in ("gaps_over_time", "window_s")}
    return {**figures, **_failed(outcome.records), "streams": sizes.shared.hol_streams}


async def prefix(target: Target, sizes: Sizes, nonce: str) -> dict[str, Any]:
    """A long shared system prefix: TTFT of the first request vs a second sent after it."""
    outcome = await bench.prefix_reuse(target, sizes.shared, nonce)
    f = outcome.figures
    return {
        **_failed(outcome.records),
        "prompt_tokens": f["prompt_tokens"],
        "ttft_1_s": f["ttft_first_s"],
        "ttft_2_s": f["ttft_second_s"],
        "ratio": f["ratio"],
        "cached_tokens_2": f["cached_tokens_second"],
    }


async def disconnect(target: Target, sizes: Sizes, nonce: str) -> dict[str, Any]:
    """Close a long generation mid-decode, then a long prompt mid-prefill; time to server idle."""
    outcome = await bench.disconnect(target, sizes.shared, nonce)
    figures = dict(outcome.figures)
    for case, record in zip(("decode", "prefill"), outcome.records, strict=True):
        figures[case] = {**figures[case], "error": record.error}
    return figures
