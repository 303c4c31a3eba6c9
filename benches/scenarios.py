"""The serving scenarios: what load each one sends to a running server and what it reports."""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import sysconfig
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import loadgen
from loadgen import Prompt, stream_one, summarize
from servers import CpuSampler
from tokenizers import Tokenizer

from mlxgate.bench.load import make_client, story_prompt
from mlxgate.bench.records import Record


@dataclass(frozen=True)
class Sizes:
    """Scenario sizes; `quick()` shrinks them for a smoke test."""

    c1: tuple[int, int] = (4, 128)  # requests, output tokens
    c8: tuple[int, int] = (16, 128)
    c32: tuple[int, int] = (64, 128)
    edit: tuple[int, int] = (5, 256)  # files, output tokens
    long_prompts: int = 8
    long_tokens: int = 1500
    long_output: int = 32
    hol_streams: int = 4
    hol_output: int = 256
    hol_prompt: int = 1500
    hol_delay_s: float = 2.0
    prefix_tokens: int = 4000
    disconnect_output: int = 1000
    disconnect_prompt: int = 3000
    disconnect_close_s: float = 1.0
    observe_s: float = 30.0  # how long to watch for the server going idle after a close
    request_timeout_s: float = 1800.0  # a request fails after this long in all
    stall_s: float = 600.0  # or after this long without a byte (a hung server)

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            c1=(2, 32),
            c8=(8, 32),
            c32=(32, 16),
            edit=(2, 48),
            long_prompts=4,
            long_tokens=500,
            long_output=8,
            hol_output=96,
            hol_prompt=500,
            prefix_tokens=1000,
            disconnect_prompt=1500,
            observe_s=20.0,
            request_timeout_s=900.0,
            stall_s=240.0,
        )


@dataclass(frozen=True)
class Target:
    url: str
    dialect: str
    model: str
    pid: int  # the server's root process, for CPU sampling


# Prompt text -------------------------------------------------------------------------------


@cache
def _tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@cache
def _words(model_dir: Path) -> tuple[str, ...]:
    """Whole lowercase words from the vocabulary (byte-level BPE marks a leading space as Ġ)."""
    vocab = _tokenizer(model_dir).get_vocab()
    return tuple(
        sorted(t[1:] for t in vocab if t.startswith("Ġ") and t[1:].isalpha() and t[1:].islower())
    )


def filler(model_dir: Path, tokens: int, seed: str) -> str:
    """Plain text of exactly `tokens` tokens, different for every seed from its first word."""
    rng = random.Random(seed)
    words = _words(model_dir)
    sentences = []
    for _ in range(tokens // 6 + 8):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(6, 14)))
        sentences.append(sentence.capitalize() + ".")
    tokenizer = _tokenizer(model_dir)
    ids = tokenizer.encode(" ".join(sentences), add_special_tokens=False).ids[:tokens]
    return tokenizer.decode(ids)


def long_prompt(model_dir: Path, tokens: int, seed: str) -> Prompt:
    """A user prompt of about `tokens` tokens (with the chat template's few) that answers short."""
    return Prompt(
        f"Notes {seed}:\n{filler(model_dir, tokens - 40, seed)}\n\nSummarize these notes in one "
        "sentence."
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
        timeout_s=sizes.request_timeout_s,
        stall_s=sizes.stall_s,
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
        timeout_s=sizes.request_timeout_s,
        stall_s=sizes.stall_s,
    )
    return {**summarize(run), "concurrency": 1, "max_tokens": max_tokens}


async def long_prompts(target: Target, sizes: Sizes, model_dir: Path, nonce: str) -> dict[str, Any]:
    """`long_prompts` different long prompts at once: how long until each starts answering."""
    prompts = [
        long_prompt(model_dir, sizes.long_tokens, f"{nonce}-{i}") for i in range(sizes.long_prompts)
    ]
    run = await loadgen.run_load(
        target.url,
        target.dialect,
        prompts,
        concurrency=sizes.long_prompts,
        requests=sizes.long_prompts,
        max_tokens=sizes.long_output,
        model=target.model,
        timeout_s=sizes.request_timeout_s,
        stall_s=sizes.stall_s,
    )
    return summarize(run)


async def head_of_line(target: Target, sizes: Sizes, model_dir: Path, nonce: str) -> dict[str, Any]:
    """Streams decoding while a long prompt arrives: the longest gap they see during its prefill.

    The prefill window runs from sending the long prompt to its first content delta. A gap
    counts if it overlaps the window, so the gap that ends when the stall ends is included.
    """
    async with make_client(sizes.hol_streams + 1, sizes.stall_s) as client:
        started = [asyncio.Event() for _ in range(sizes.hol_streams)]
        streams = [
            asyncio.create_task(
                stream_one(
                    client,
                    target.url,
                    target.dialect,
                    story_prompt(i),
                    sizes.hol_output,
                    index=i,
                    model=target.model,
                    first_delta=started[i],
                    timeout_s=sizes.request_timeout_s,
                )
            )
            for i in range(sizes.hol_streams)
        ]
        await _all_started(started, streams, sizes.stall_s)
        await asyncio.sleep(sizes.hol_delay_s)
        long = await stream_one(
            client,
            target.url,
            target.dialect,
            long_prompt(model_dir, sizes.hol_prompt, nonce),
            4,
            index=sizes.hol_streams,
            model=target.model,
            timeout_s=sizes.request_timeout_s,
        )
        results: list[Record] = await asyncio.gather(*streams)
    window_start = long.sent_at
    window_end = long.delta_times[0] if long.delta_times else long.ended_at
    during = [
        b - a
        for r in results
        for a, b in itertools.pairwise(r.delta_times)
        if b > window_start and a < window_end
    ]
    gaps = [g for r in results for g in r.gaps]
    median = statistics.median(gaps) if gaps else None
    worst = max(during) if during else None
    return {
        "streams": len(results),
        "failed": sum(not r.ok for r in results) + (not long.ok),
        "errors": [r.error for r in [*results, long] if r.error],
        "prefill_s": window_end - window_start,
        "long_prompt_tokens": long.input_tokens,
        "max_gap_during_s": worst,
        "median_gap_s": median,
        "ratio": worst / median if worst and median else None,
        "gaps_during_s": [round(g, 3) for g in during],
        # Streams that were still decoding when the prefill ended: fewer means the case
        # measured less than it should (the streams finished too early).
        "streams_alive": sum(
            bool(r.delta_times) and r.delta_times[-1] >= window_end for r in results
        ),
    }


async def _all_started(
    events: list[asyncio.Event], tasks: list[asyncio.Task[Record]], limit_s: float
) -> None:
    """Wait until every stream has its first delta, one has ended without one, or `limit_s`."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and not all(e.is_set() for e in events):
        if any(t.done() and not e.is_set() for t, e in zip(tasks, events, strict=True)):
            return
        await asyncio.sleep(0.05)


async def prefix(target: Target, sizes: Sizes, model_dir: Path, nonce: str) -> dict[str, Any]:
    """A long shared system prefix: TTFT of the first request vs a second sent after it."""
    system = f"Reference notes {nonce}:\n{filler(model_dir, sizes.prefix_tokens, nonce)}"
    questions = ("What is the first word of the notes?", "How many sentences do the notes have?")
    results = []
    async with make_client(1, sizes.stall_s) as client:
        for i, question in enumerate(questions):
            results.append(
                await stream_one(
                    client,
                    target.url,
                    target.dialect,
                    Prompt(question, system=system),
                    8,
                    index=i,
                    model=target.model,
                    timeout_s=sizes.request_timeout_s,
                )
            )
    first, second = results
    ratio = None
    if first.ttft_s and second.ttft_s:
        ratio = second.ttft_s / first.ttft_s
    return {
        "failed": sum(not r.ok for r in results),
        "errors": [r.error for r in results if r.error],
        "prompt_tokens": first.input_tokens,
        "ttft_1_s": first.ttft_s,
        "ttft_2_s": second.ttft_s,
        "ratio": ratio,
        "cached_tokens_2": second.cached_tokens,
    }


async def _close_and_watch(
    target: Target, prompt: Prompt, max_tokens: int, close: str, sizes: Sizes
) -> dict[str, Any]:
    """Send one request, close it (`close`: "after-first-delta" or "after-send"), watch CPU."""
    with CpuSampler(target.pid, limit_s=sizes.request_timeout_s) as sampler:
        await asyncio.sleep(1.0)  # a baseline before the request
        baseline = sampler.usage(time.monotonic() - 1.0, time.monotonic())
        first = asyncio.Event()

        async def close_time() -> None:
            if close == "after-first-delta":
                await first.wait()
            await asyncio.sleep(sizes.disconnect_close_s)

        async with make_client(1, sizes.stall_s) as client:
            result = await stream_one(
                client,
                target.url,
                target.dialect,
                prompt,
                max_tokens,
                model=target.model,
                first_delta=first,
                close_when=close_time(),
                timeout_s=sizes.request_timeout_s,
            )
        closed_at = time.monotonic()
        deadline = closed_at + sizes.observe_s
        idle_at = None
        while time.monotonic() < deadline and idle_at is None:
            await asyncio.sleep(0.25)
            idle_at = sampler.idle_since(closed_at)
        busy = sampler.usage(closed_at - 0.5, closed_at)
    return {
        "closed_early": result.closed_early,
        "error": result.error,
        "closed_in_prefill": result.ttft_s is None,
        "baseline_cores": baseline,
        "busy_cores_before_close": busy,
        "idle_after_s": None if idle_at is None else idle_at - closed_at,
        "observed_s": sizes.observe_s,
    }


async def wait_idle(pid: int, limit_s: float) -> float | None:
    """Seconds until the server is idle (None: not within `limit_s`)."""
    with CpuSampler(pid, limit_s=limit_s) as sampler:
        started = time.monotonic()
        while time.monotonic() - started < limit_s:
            await asyncio.sleep(0.25)
            if (idle_at := sampler.idle_since(started)) is not None:
                return idle_at - started
    return None


async def disconnect(target: Target, sizes: Sizes, model_dir: Path, nonce: str) -> dict[str, Any]:
    """Close a long generation mid-decode, then a long prompt mid-prefill; time to server idle."""
    decode = await _close_and_watch(
        target, story_prompt(0), sizes.disconnect_output, "after-first-delta", sizes
    )
    settle = await wait_idle(target.pid, min(300.0, sizes.request_timeout_s))
    prompt = long_prompt(model_dir, sizes.disconnect_prompt, nonce)
    prefill = await _close_and_watch(target, prompt, 16, "after-send", sizes)
    return {"decode": decode, "prefill": prefill, "settle_s": settle}
