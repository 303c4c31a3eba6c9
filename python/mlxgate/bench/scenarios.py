"""The scenarios beside the concurrency sweep and the agent replay. Each sends its load to one
target and returns its records with the figures only it has:

- `long`: different long prompts at once: how long each waits for its first token;
- `hol` (head-of-line): streams decoding while a long prompt lands: the longest inter-token gap
  they see during its prefill, against their median gap;
- `prefix`: a long shared system prompt asked twice: the second TTFT against the first, and the
  prompt tokens the server says it reused;
- `disconnect`: a long generation closed mid-decode, then a long prompt closed mid-prefill: how
  long the server goes on burning CPU for a client that left (read from /proc: needs the pid);
- `edit`: one client asking for standard-library files back with a rename, one after the other
  (an agent's Edit/Write, the case speculative decoding is for): the decode rate after the first
  token and, from mlxgate's /metrics, the guesses drafted and kept.

Prompts are plain words, about `tokens` tokens long by a BPE vocabulary's count; the servers'
usage reports what they counted.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import sysconfig
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from mlxgate.bench.load import Load, Prompt, make_client, run, send_prompt, story_prompt
from mlxgate.bench.machine import CpuSampler
from mlxgate.bench.records import Record
from mlxgate.bench.target import Target

_COMMON_WORDS = (
    "time people year way day thing world life hand part child eye place work week case point "
    "number group problem fact water room mother area money story month book job word side kind "
    "head house friend father power hour game line end member city name team minute idea body "
    "back face level office door health art war history party result change morning reason "
    "girl moment air teacher force river garden window letter table road market summer winter "
    "stone field music paper light voice forest island bridge village station engine"
)
WORDS = tuple(_COMMON_WORDS.split())
TOKENS_PER_WORD = 1.25  # these words with a space and an occasional full stop, by BPE
SAME_STEP_S = 0.001  # token frames closer than this came from one server step


@dataclass(frozen=True)
class Sizes:
    long_prompts: int = 4
    long_tokens: int = 1500
    long_output: int = 32
    hol_streams: int = 4
    hol_output: int = 256
    hol_prompt: int = 1500
    hol_delay_s: float = 2.0  # streams decode this long before the long prompt is sent
    prefix_tokens: int = 3000
    disconnect_output: int = 1000
    disconnect_prompt: int = 3000
    close_after_s: float = 1.0
    observe_s: float = 30.0  # how long to watch for the server going idle after a close
    edit_files: int = 5
    edit_output: int = 256
    timeout_s: float = 1800.0  # a request fails after this long in all
    stall_s: float = 600.0  # or after this long without a byte

    def with_hol_prompt(self, tokens: int) -> Sizes:
        """The head-of-line scenario with a long prompt of `tokens`: its streams decode about a
        token for each eight it prefills (four streams beside a prefill of a third of each
        step), so that they still decode when it ends."""
        return replace(self, hol_prompt=tokens, hol_output=max(self.hol_output, tokens // 8))

    @classmethod
    def quick(cls) -> Sizes:
        """Small enough for a smoke run (a minute or two a target here)."""
        return cls(
            long_prompts=2,
            long_tokens=400,
            long_output=8,
            hol_streams=2,
            hol_output=64,
            hol_prompt=400,
            hol_delay_s=0.5,
            prefix_tokens=600,
            disconnect_output=200,
            disconnect_prompt=1200,
            close_after_s=0.5,
            observe_s=10.0,
            edit_files=2,
            edit_output=48,
        )


@dataclass
class Outcome:
    records: list[Record]
    figures: dict[str, Any] = field(default_factory=dict)


Scenario = Callable[[Target, Sizes, str], Coroutine[Any, Any, Outcome]]


def filler(tokens: int, seed: str) -> str:
    """Sentences of common words, about `tokens` tokens, different for every seed from its
    first word (so no server can reuse another prompt's prefix)."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(int(tokens / TOKENS_PER_WORD))]
    sentences = []
    while words:
        length = rng.randint(6, 14)
        sentences.append(" ".join(words[:length]).capitalize() + ".")
        words = words[length:]
    return " ".join(sentences)


def long_prompt(tokens: int, seed: str) -> Prompt:
    """A user prompt of about `tokens` tokens that answers short."""
    notes = filler(tokens, seed)
    return Prompt(f"Notes {seed}:\n{notes}\n\nSummarize these notes in one sentence.")


async def long_prompts(target: Target, sizes: Sizes, nonce: str) -> Outcome:
    load = Load(
        target.url,
        target.dialect,
        sizes.long_prompts,
        sizes.long_prompts,
        sizes.long_output,
        target.model,
        prompt=lambda i: long_prompt(sizes.long_tokens, f"{nonce}-{i}"),
        timeout_s=sizes.timeout_s,
        stall_s=sizes.stall_s,
    )
    return Outcome(await run(load))


async def head_of_line(target: Target, sizes: Sizes, nonce: str) -> Outcome:
    """The prefill window runs from sending the long prompt to its first token. A gap counts if it
    overlaps the window, so the gap that ends when the stall ends is included."""
    async with make_client(sizes.hol_streams + 1, sizes.stall_s) as client:

        def one(index: int, prompt: Prompt, max_tokens: int, first: asyncio.Event | None) -> Any:
            return send_prompt(
                client, target.url, target.dialect, prompt, max_tokens, index=index,
                model=target.model, first_token=first, timeout_s=sizes.timeout_s,
            )  # fmt: skip

        started = [asyncio.Event() for _ in range(sizes.hol_streams)]
        streams = [
            asyncio.ensure_future(one(i, story_prompt(i), sizes.hol_output, started[i]))
            for i in range(sizes.hol_streams)
        ]
        await _all_started(started, streams, sizes.stall_s)
        await asyncio.sleep(sizes.hol_delay_s)
        long = await one(sizes.hol_streams, long_prompt(sizes.hol_prompt, nonce), 4, None)
        records: list[Record] = await asyncio.gather(*streams)
    window_start = long.sent_at
    window_end = long.delta_times[0] if long.delta_times else long.ended_at
    during = [
        b - a
        for r in records
        for a, b in itertools.pairwise(r.delta_times)
        if b > window_start and a < window_end
    ]
    # The tokens of one step (guesses kept) arrive together: the median is a step's gap.
    gaps = [g for r in records for g in r.gaps if g >= SAME_STEP_S]
    median = statistics.median(gaps) if gaps else None
    worst = max(during) if during else None
    return Outcome(
        [*records, long],
        {
            "prefill_s": window_end - window_start,
            "long_prompt_tokens": long.input_tokens,
            "max_gap_during_s": worst,
            "median_gap_s": median,
            "ratio": worst / median if worst and median else None,
            # Every stream's gaps as (arrival from the long prompt's send, gap): the plot.
            "gaps_over_time": [
                [round(b - window_start, 4), round(b - a, 4)]
                for r in records
                for a, b in itertools.pairwise(r.delta_times)
            ],
            "window_s": [0.0, round(window_end - window_start, 4)],
            # Streams still decoding when the prefill ended: fewer, and it measured less.
            "streams_alive": sum(
                bool(r.delta_times) and r.delta_times[-1] >= window_end for r in records
            ),
        },
    )


async def _all_started(
    events: list[asyncio.Event], tasks: list[asyncio.Future[Record]], limit_s: float
) -> None:
    """Wait until every stream has its first token, one has ended without one, or `limit_s`."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and not all(e.is_set() for e in events):
        if any(t.done() and not e.is_set() for t, e in zip(tasks, events, strict=True)):
            return
        await asyncio.sleep(0.05)


async def prefix_reuse(target: Target, sizes: Sizes, nonce: str) -> Outcome:
    system = f"Reference notes {nonce}:\n{filler(sizes.prefix_tokens, nonce)}"
    questions = ("What is the first word of the notes?", "How many sentences do the notes have?")
    load = Load(
        target.url,
        target.dialect,
        len(questions),
        1,
        8,
        target.model,
        prompt=lambda i: Prompt(questions[i], system=system),
        timeout_s=sizes.timeout_s,
        stall_s=sizes.stall_s,
    )
    first, second = records = await run(load)
    ratio = second.ttft_s / first.ttft_s if first.ttft_s and second.ttft_s else None
    return Outcome(
        records,
        {
            "prompt_tokens": first.input_tokens,
            "ttft_first_s": first.ttft_s,
            "ttft_second_s": second.ttft_s,
            "ratio": ratio,
            "cached_tokens_second": second.cached_tokens,
        },
    )


async def disconnect(target: Target, sizes: Sizes, nonce: str) -> Outcome:
    if target.pid is None:
        return Outcome([], {"skipped": "the target's pid is needed to read its CPU"})
    decode_record, decode = await _close_and_watch(
        target, story_prompt(0), sizes.disconnect_output, sizes, after_first_token=True
    )
    settle_s = await _wait_idle(target.pid, min(300.0, sizes.timeout_s))
    prompt = long_prompt(sizes.disconnect_prompt, nonce)
    prefill_record, prefill = await _close_and_watch(
        target, prompt, 16, sizes, after_first_token=False
    )
    return Outcome(
        [decode_record, prefill_record],
        # settle_s: from the first case's end to an idle server (None: still busy at the second)
        {"decode": decode, "prefill": prefill, "settle_s": settle_s},
    )


async def _close_and_watch(
    target: Target, prompt: Prompt, max_tokens: int, sizes: Sizes, *, after_first_token: bool
) -> tuple[Record, dict[str, Any]]:
    """Send one request, close it `close_after_s` after its first token (or after the send),
    then watch the server's CPU until it goes idle."""
    assert target.pid is not None
    with CpuSampler(target.pid, limit_s=sizes.timeout_s) as sampler:
        await asyncio.sleep(1.0)  # a baseline before the request
        baseline = sampler.usage(time.monotonic() - 1.0, time.monotonic())
        first = asyncio.Event()

        async def close_time() -> None:
            if after_first_token:
                await first.wait()
            await asyncio.sleep(sizes.close_after_s)

        async with make_client(1, sizes.stall_s) as client:
            record = await send_prompt(
                client, target.url, target.dialect, prompt, max_tokens, model=target.model,
                first_token=first, close_when=close_time(), timeout_s=sizes.timeout_s,
            )  # fmt: skip
        closed_at = time.monotonic()
        idle_at = None
        while time.monotonic() < closed_at + sizes.observe_s and idle_at is None:
            await asyncio.sleep(0.25)
            idle_at = sampler.idle_since(closed_at)
        busy = sampler.usage(closed_at - 0.5, closed_at)
    return record, {
        "closed_early": record.closed_early,
        "closed_in_prefill": record.ttft_s is None,
        "baseline_cores": baseline,
        "busy_cores_before_close": busy,
        "idle_after_s": None if idle_at is None else idle_at - closed_at,
        "observed_s": sizes.observe_s,
    }


async def _wait_idle(pid: int, limit_s: float) -> float | None:
    """Seconds until the server is idle (None: not within `limit_s`)."""
    with CpuSampler(pid, limit_s=limit_s) as sampler:
        started = time.monotonic()
        while time.monotonic() - started < limit_s:
            await asyncio.sleep(0.25)
            if (idle_at := sampler.idle_since(started)) is not None:
                return idle_at - started
    return None


# (standard-library file, a name in it, the new name): 150-250 lines each, a rename to ask for.
EDITS = (
    ("colorsys.py", "rgb_to_yiq", "rgb_to_ntsc"),
    ("genericpath.py", "getsize", "file_size"),
    ("sched.py", "enterabs", "enter_at"),
    ("fnmatch.py", "translate", "to_regex"),
    ("glob.py", "glob1", "glob_one"),
)
SPECULATION_COUNTERS = ("verify_passes", "drafted_tokens", "accepted_tokens")


def edit_prompt(file: str, old: str, new: str) -> Prompt:
    """A source file and a request for it back with one small change (an agent's Edit/Write)."""
    source = (Path(sysconfig.get_paths()["stdlib"]) / file).read_text()
    return Prompt(
        f"Here is {file}:\n```python\n{source}```\nRewrite the whole file with {old} renamed "
        f"to {new}. Output the complete file only."
    )


async def edit(target: Target, sizes: Sizes, nonce: str) -> Outcome:
    """The files one after the other, one client. A reply copies most of its prompt, so prompt
    lookup's guesses are mostly kept: compare mlxgate with `--max-draft-tokens 0`
    (`--spawn mlxgate-plain`). The prompts are the same every run (a server's prefix cache may
    serve a second run)."""
    before = await speculation_counters(target.url)
    load = Load(
        target.url,
        target.dialect,
        sizes.edit_files,
        1,
        sizes.edit_output,
        target.model,
        prompt=lambda i: edit_prompt(*EDITS[i % len(EDITS)]),
        timeout_s=sizes.timeout_s,
        stall_s=sizes.stall_s,
    )
    records = await run(load)
    after = await speculation_counters(target.url)
    # Per request, after its first token (prefill left out), over all requests.
    decoding = [
        (r.output_tokens - 1, r.ended_at - r.sent_at - r.ttft_s)
        for r in records
        if r.ok and r.output_tokens and r.ttft_s is not None
    ]
    decode_s = sum(s for _, s in decoding)
    speculation = None
    if before is not None and after is not None:
        speculation = {name: after[name] - before[name] for name in SPECULATION_COUNTERS}
    return Outcome(
        records,
        {
            "decode_tok_s": sum(n for n, _ in decoding) / decode_s if decode_s > 0 else None,
            "speculation": speculation,
        },
    )


async def speculation_counters(url: str) -> dict[str, float] | None:
    """mlxgate's speculative-decoding counters from /metrics (None: a server without them)."""
    try:
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
            response = await client.get(f"{url}/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    wanted = {f"mlxgate_engine_{name}": name for name in SPECULATION_COUNTERS}
    try:
        found = {
            wanted[family.name]: family.samples[0].value
            for family in text_string_to_metric_families(response.text)
            if family.name in wanted and family.samples
        }
    except ValueError:  # not Prometheus text
        return None
    return found if len(found) == len(wanted) else None


SCENARIOS: dict[str, Scenario] = {
    "long": long_prompts,
    "hol": head_of_line,
    "prefix": prefix_reuse,
    "disconnect": disconnect,
    "edit": edit,
}
