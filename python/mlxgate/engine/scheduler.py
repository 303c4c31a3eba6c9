"""The scheduler: what each engine step does, decided before the step runs.

Between two steps the engine asks the scheduler for the step's plan (engine/plan.py): which
decoding sequences make room for the KV memory budget (the youngest first), and how much the
step prefills: its token budget, its time allowance, the order in which the waiting prompts are
served (the least prefill left first, a long wait counting for a prompt too), the chunk sizes and
the prompt groups. Its inputs are the settings and what the engine measured as it ran (the time
of a decode step and of one prefilled token); it never touches MLX, so its decisions are tested
alone (tests/test_scheduler.py). Across ranks, rank 0's plan is the one every rank runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from mlxgate.engine.settings import EngineSettings

# Prompts prefilled in one batched forward pass at most.
MAX_GROUP_ROWS = 32
# Weight of the newest sample in the running averages of step and prefill costs.
EMA_WEIGHT = 0.2
# How much a waiting prompt's wait counts against its prefill left (see `Scheduler.rank`).
AGE_WEIGHT = 0.1
# The cost of a prefilled token before any is measured (SmolLM2-135M on 2 x86 cores: ~5 ms).
DEFAULT_PREFILL_TOKEN_S = 0.005


def ema(previous: float | None, sample: float, weight: float = EMA_WEIGHT) -> float:
    return sample if previous is None else previous + weight * (sample - previous)


class Waiting(Protocol):
    """What the scheduler reads of a waiting prompt (engine/prefill.py's `Pending`)."""

    stream_id: int
    submitted_at: float  # time.monotonic() at admission
    last_chunk: tuple[int, float] | None  # (tokens, seconds) of its latest prefill pass

    @property
    def rest(self) -> int: ...


@dataclass
class PrefillPlan:
    """How much one step prefills, decided before it runs: every rank runs the same plan."""

    budget: int  # prompt tokens
    allowance_s: float | None  # seconds beside decoding streams; None when nothing limits it
    kv_room: int | None  # bytes of the KV memory budget new prefills may take; None: no budget
    order: list[int]  # the waiting prompts' stream ids, in the order the step serves them
    token_s: float  # what a prefilled token costs (spent tokens count against the allowance)
    # Each prompt in prefill's latest pass, (tokens, seconds): its next chunk is sized from it.
    last_chunks: dict[int, tuple[int, float]] = field(default_factory=dict)

    def left_s(self, spent: int) -> float | None:
        """Seconds of the allowance left once the step has prefilled `spent` tokens."""
        if self.allowance_s is None:
            return None
        return self.allowance_s - spent * self.token_s


@dataclass
class Scheduler:
    """Each step's plan, from the settings and what decode steps and prefill passes have cost."""

    settings: EngineSettings
    decode_s: float | None = None  # a decode step, seconds (running average)
    prefill_token_s: float | None = None  # one prefilled token, seconds (running average)

    def decoded(self, seconds: float) -> None:
        """A step's decode took `seconds`."""
        self.decode_s = ema(self.decode_s, seconds)

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A step's prefill took `seconds` for `tokens` prompt tokens; fewer than a minimum chunk
        say little about the rate and are not counted."""
        if tokens >= self.settings.min_prefill_chunk:
            self.prefill_token_s = ema(self.prefill_token_s, seconds / tokens)

    def prefill_plan(
        self, decoding: int, waiting: Sequence[Waiting], kv_room: int | None, now: float
    ) -> PrefillPlan:
        """The prefill of a step beside `decoding` streams, with `kv_room` bytes free for new
        prompts, at `now` (time.monotonic())."""
        allowance_s = self.allowance_s(decoding, len(waiting))
        ranked = sorted(waiting, key=lambda p: self.rank(p.rest, now - p.submitted_at))
        return PrefillPlan(
            self.budget(decoding, allowance_s),
            allowance_s,
            kv_room,
            [p.stream_id for p in ranked],
            self.prefill_token_s or DEFAULT_PREFILL_TOKEN_S,
            {p.stream_id: p.last_chunk for p in waiting if p.last_chunk is not None},
        )

    @staticmethod
    def preemption_order(running: Iterable[tuple[int, float]]) -> list[int]:
        """Which decoding sequences (stream id, admitted at) give their caches back first when the
        KV memory budget runs short: the youngest; the oldest always goes on (a prompt that cannot
        fit alone was refused at admission)."""
        by_age = sorted(running, key=lambda row: row[1], reverse=True)
        return [stream_id for stream_id, _ in by_age[:-1]]

    def allowance_s(self, decoding: int, waiting: int) -> float | None:
        """Seconds of prefill a step may add to decoding `decoding` streams while `waiting`
        sequences wait; None when nothing limits it."""
        s = self.settings
        if not decoding or s.step_token_budget or self.decode_s is None:
            return None
        # More prompts waiting than streams decoding: the waiting clients get the larger share.
        stretch = max(1.0, waiting / decoding)
        return (s.max_step_ratio - 1.0) * self.decode_s * stretch

    def rank(self, rest: int, waited_s: float) -> float:
        """Which waiting prompt a step serves first: the lowest rank. Its prefill left, in
        seconds, less a tenth of the time it has waited: an agent's 100-token turn goes before a
        12k-token first turn that has been prefilling for minutes, and a long prompt still goes
        before newer short ones once it has waited ten times what their prefill takes."""
        per_token = self.prefill_token_s or DEFAULT_PREFILL_TOKEN_S
        return rest * per_token - AGE_WEIGHT * waited_s

    def budget(self, decoding: int, allowance_s: float | None) -> int:
        """Prompt tokens a step may prefill without stalling the `decoding` streams too long."""
        s = self.settings
        if not decoding:
            return s.max_prefill_tokens  # nobody waits on this step: go for throughput
        if s.step_token_budget:
            return max(s.min_prefill_chunk, s.step_token_budget - decoding)
        if allowance_s is None or self.prefill_token_s is None:
            return s.min_prefill_chunk
        fits = allowance_s / self.prefill_token_s
        return int(min(s.max_prefill_tokens, max(s.min_prefill_chunk, fits)))

    def chunk(self, budget: int, todo: int) -> int:
        """The next chunk of a prompt with `todo` tokens left, out of `budget`."""
        return min(budget, todo, self.settings.max_prefill_chunk)

    def steered_chunk(self, last_chunk: tuple[int, float], todo: int, allowance_s: float) -> int:
        """The next chunk of a prompt in prefill, sized from its own previous pass (`last_chunk`:
        its tokens and seconds) to take about `allowance_s`.

        A pass costs a fixed part (every weight is read once) plus a part per token that grows
        with the prompt's length so far, which a global per-token rate does not capture.
        """
        tokens, took = last_chunk
        steered = int(tokens * allowance_s / max(took, 1e-3))
        steered = min(2 * tokens, max(tokens // 2, steered))
        s = self.settings
        return min(todo, s.max_prefill_chunk, max(s.min_prefill_chunk, steered))

    def group(self, rests: Iterable[int | None], budget: int, room: int) -> list[int]:
        """Which prompts at the head of the queue to prefill in one pass: the uncached rests of
        the first of them (`rests`, in queue order; None for one that cannot join a group), two
        or more that fit `budget` together with their padding to the longest, while padding stays
        under a quarter of the work; [] for none. At most `room` rows (and MAX_GROUP_ROWS)."""
        taken: list[int] = []
        for count, rest in enumerate(rests):
            if count >= min(room, MAX_GROUP_ROWS) or rest is None:
                break
            if rest == 0 or rest > self.settings.max_prefill_chunk:
                break
            padded = max(rest, *taken, 0) * (len(taken) + 1)
            if padded > budget or padded > 1.25 * (sum(taken) + rest):
                break
            taken.append(rest)
        return taken if len(taken) >= 2 else []
