"""The serving scenarios: what load each one sends to a running server and what it reports.
Long prompts, head-of-line, prefix reuse and disconnect are `mlxgate bench`'s own
(mlxgate/bench/scenarios.py); this script adds the sweep points and the edit case it has
always reported, and its tables."""

from __future__ import annotations

import statistics
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mlxgate.bench import scenarios as bench
from mlxgate.bench.figures import Slo
from mlxgate.bench.figures import summarize as figures
from mlxgate.bench.load import Load, Prompt, run, story_prompt
from mlxgate.bench.records import Record
from mlxgate.bench.target import Target

# Goodput's service-level objective (`mlxgate bench`'s default).
SLO = Slo()


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


def summarize(records: Sequence[Record], wall_s: float) -> dict[str, Any]:
    """`mlxgate bench`'s figures of a run, flat, with the decode rate and each request's TTFT
    by when it was sent (where a tail comes from) that serving.py's tables show."""
    f = figures(records, wall_s, SLO)
    ok = [r for r in records if r.ok]
    decoding = [
        (r.output_tokens - 1, r.ended_at - r.sent_at - r.ttft_s)
        for r in ok
        if r.output_tokens and r.ttft_s is not None
    ]
    decode_s = sum(s for _, s in decoding)
    first_sent = min((r.sent_at for r in records), default=0.0)
    return {
        "requests": f["requests"],
        "failed": f["failed"],
        "errors": [r.error for r in records if r.error],
        "wall_s": wall_s,
        "output_tokens": f["output_tokens"],
        "output_tok_s": f["output_tok_s"],
        # Per request, after its first token (prefill left out), over all requests.
        "decode_tok_s": sum(n for n, _ in decoding) / decode_s if decode_s > 0 else 0.0,
        "goodput_tok_s": f["goodput_tok_s"],
        "mean_output_tokens": f["output_tokens"] / len(ok) if ok else 0.0,
        "mean_input_tokens": statistics.mean(r.input_tokens or 0 for r in ok) if ok else 0.0,
        **{f"ttft_{q}_s": f["ttft_s"][q] for q in ("p50", "p95", "p99")},
        **{f"itl_{q}_s": f["itl_s"][q] for q in ("p50", "p95", "max")},
        "sent_s": [round(r.sent_at - first_sent, 3) for r in records],
        "ttfts_s": [None if r.ttft_s is None else round(r.ttft_s, 3) for r in records],
    }


async def _closed_loop(
    target: Target, sizes: Sizes, prompts: Sequence[Prompt], concurrency: int, max_tokens: int
) -> dict[str, Any]:
    """Every prompt once, at most `concurrency` in flight."""
    load = Load(
        target.url,
        target.dialect,
        len(prompts),
        concurrency,
        max_tokens,
        target.model,
        prompt=lambda i: prompts[i],
        timeout_s=sizes.shared.timeout_s,
        stall_s=sizes.shared.stall_s,
    )
    began = time.monotonic()
    records = await run(load)
    return {
        **summarize(records, time.monotonic() - began),
        "concurrency": concurrency,
        "max_tokens": max_tokens,
    }


# Scenarios ---------------------------------------------------------------------------------


async def concurrency(target: Target, sizes: Sizes, c: int) -> dict[str, Any]:
    """C clients, each request a different story prompt, `max_tokens` output tokens asked."""
    requests, max_tokens = getattr(sizes, f"c{c}")
    prompts = [story_prompt(i) for i in range(requests)]
    return await _closed_loop(target, sizes, prompts, c, max_tokens)


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
    return await _closed_loop(target, sizes, prompts, 1, max_tokens)


async def long_prompts(target: Target, sizes: Sizes, nonce: str) -> dict[str, Any]:
    """`long_prompts` different long prompts at once: how long until each starts answering."""
    began = time.monotonic()
    outcome = await bench.long_prompts(target, sizes.shared, nonce)
    return summarize(outcome.records, time.monotonic() - began)


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
