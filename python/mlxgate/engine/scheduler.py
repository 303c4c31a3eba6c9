"""The scheduler: what each engine step does, decided before the step runs.

Between two steps the engine asks the scheduler for the step's plan (engine/plan.py): which
decoding sequences make room for the KV memory budget (the youngest first), how many guesses
the decode step verifies (as many as pay for their positions in the pass), and how much the
step prefills: its token budget, its time allowance, the order in which the waiting prompts are
served (the least prefill left first, a long wait counting for a prompt too), the chunk sizes and
the prompt groups. Its inputs are the settings and what the engine measured as it ran: a decode
step's time, a verify pass's (a fixed part plus a part per guessed position) and a prefill
pass's (a fixed part, every weight read once, plus a part per token: lines fitted to the
passes). It never touches MLX, so its decisions are tested alone
(tests/test_scheduler.py). Across ranks, rank 0's plan is the one every rank runs.
"""

from __future__ import annotations

import math
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
# Passes of sizes this alike (their spread under this share of their mean size) cannot tell a
# pass's fixed part from its part per token.
MIN_SIZE_SPREAD = 0.5
# Weight of a prompt's latest pass in the time its next chunk is sized from.
CHUNK_WEIGHT = 0.5
# Steps without guesses, while rows want to guess, after which a verify pass is tried again.
PROBE_EVERY = 16
# Passes after more context than this are left out of the line: their attention costs a token
# more the longer the prompt (a chunk at 10k tokens: ~5x one at the start), which a line does not
# fit, and a prompt in prefill sizes its chunks from its own passes.
LINE_CONTEXT = 1024


def ema(previous: float | None, sample: float, weight: float = EMA_WEIGHT) -> float:
    return sample if previous is None else previous + weight * (sample - previous)


def chunk_cost(
    previous: tuple[int, float] | None, tokens: int, seconds: float
) -> tuple[int, float]:
    """What a prompt's pass of `tokens` costs, for sizing its next chunk: the `seconds` its latest
    took, averaged with its previous passes' (`previous`, scaled to `tokens`). One pass's time
    varies by a fifth or more (the decode step beside it, the machine); sized from it alone, the
    next chunk overruns the step's allowance by as much."""
    if previous is None or previous[0] <= 0:
        return tokens, seconds
    scaled = previous[1] * tokens / previous[0]
    return tokens, ema(scaled, seconds, CHUNK_WEIGHT)


@dataclass
class DecayedLine:
    """The least-squares line through (x, y) samples, each older one weighing `1 - EMA_WEIGHT` of
    the next."""

    # Decayed sums: weight, x, y, x squared, x times y.
    _sums: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)

    def add(self, x: float, y: float) -> tuple[float, float, float | None]:
        """Take a sample; returns the means of x and y, and the slope, None where the samples'
        x are too alike to tell it (their spread under MIN_SIZE_SPREAD of their mean)."""
        keep = 1.0 - EMA_WEIGHT
        w, sx, sy, sxx, sxy = (keep * total for total in self._sums)
        self._sums = (w + 1, sx + x, sy + y, sxx + x * x, sxy + x * y)
        w, sx, sy, sxx, sxy = self._sums
        mean_x, mean_y = sx / w, sy / w
        spread = sxx / w - mean_x * mean_x
        if spread <= (MIN_SIZE_SPREAD * mean_x) ** 2:
            return mean_x, mean_y, None
        return mean_x, mean_y, (sxy / w - mean_x * mean_y) / spread


@dataclass
class PassCost:
    """What a prefill pass costs: `fixed_s` (every weight read once, whatever its size) plus
    `token_s` a token (rows times columns, padding included), the line through the passes
    measured.

    On CPU the fixed part is about five tokens' worth (SmolLM2-135M: ~11 ms, then ~2 ms a token),
    so a per-token average over passes of 4-40 tokens overprices a token by half and starves a
    step beside decoding streams of the prompts it has time for."""

    fixed_s: float = 0.0
    token_s: float | None = None
    line: DecayedLine = field(default_factory=DecayedLine)

    def add(self, tokens: int, seconds: float) -> None:
        mean_x, mean_y, slope = self.line.add(tokens, seconds)
        # Passes of sizes too alike to tell the two parts apart (a long prompt's chunks, whose
        # times vary by a fifth) keep the fixed part they had.
        if slope is not None and slope > 0:
            self.fixed_s = max(0.0, mean_y - slope * mean_x)
        self.fixed_s = min(self.fixed_s, 0.5 * mean_y)
        self.token_s = (mean_y - self.fixed_s) / mean_x

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + tokens * (self.token_s or DEFAULT_PREFILL_TOKEN_S)


@dataclass
class VerifyCost:
    """What a verify pass costs: `fixed_s` (a plain decode step's work, and more where the pass
    leaves the decode kernels' path) plus `guess_s` a guessed position (every slot's, padding
    included), the line through the verify passes measured. A guess costs at least a prefilled
    token (`prior_guess_s`: the same matmuls, and attention over at least as much context), and
    passes of widths too alike to tell the two apart keep the cost a guess had and move the
    fixed part: through passes of one width alone, the line priced a guess at all of the pass,
    and through one row's passes, whose times vary by a third, at 0.1-2 ms where it is 2.5, a
    plain step 21 ms and the fixed part 44 (a row that keeps two guesses a pass went plain)."""

    fixed_s: float = 0.0
    guess_s: float | None = None
    line: DecayedLine = field(default_factory=DecayedLine)

    def add(self, guessed: int, seconds: float, prior_guess_s: float) -> None:
        """A verify pass over `guessed` guessed positions took `seconds`."""
        mean_x, mean_y, slope = self.line.add(guessed, seconds)
        if slope is None or slope <= 0:
            slope = self.guess_s or prior_guess_s
        self.guess_s = max(slope, prior_guess_s)
        self.fixed_s = max(0.0, mean_y - self.guess_s * mean_x)

    def seconds(self, guessed: int) -> float:
        assert self.guess_s is not None
        return self.fixed_s + guessed * self.guess_s


class Guessed(Protocol):
    """What the scheduler reads of a verify pass's guesses (engine/speculation.py's `Drafts`)."""

    made_s: float  # seconds spent making them

    @property
    def slots(self) -> int: ...

    @property
    def width(self) -> int: ...  # positions each slot feeds: its input token and the guesses


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
    token_s: float  # what a prefilled token costs, beyond its pass's fixed part
    # Each prompt in prefill's latest pass, (tokens, seconds): its next chunk is sized from it.
    last_chunks: dict[int, tuple[int, float]] = field(default_factory=dict)
    pass_s: float = 0.0  # the fixed part of a pass

    def cost_s(self, tokens: int, passes: int = 1) -> float:
        """The predicted seconds of `passes` prefill passes over `tokens` tokens (predicted, not
        timed: every rank agrees on it)."""
        return passes * self.pass_s + tokens * self.token_s

    def left_s(self, spent_s: float) -> float | None:
        """Seconds of the allowance left once the step has spent `spent_s` (`cost_s`)."""
        if self.allowance_s is None:
            return None
        return self.allowance_s - spent_s


@dataclass
class Scheduler:
    """Each step's plan, from the settings and what decode steps and prefill passes have cost."""

    settings: EngineSettings
    decode_s: float | None = None  # a decode step, seconds (running average)
    passes: PassCost = field(default_factory=PassCost)
    plain_s: float | None = None  # a decode step without guesses
    verify: VerifyCost = field(default_factory=VerifyCost)
    unguessed: int = 0  # steps running in which rows wanted to guess and none paid

    @property
    def prefill_token_s(self) -> float | None:
        return self.passes.token_s

    def decoded(self, seconds: float, drafts: Guessed | None = None) -> None:
        """A step's decode took `seconds`: a plain one, or a verify pass over `drafts`."""
        self.decode_s = ema(self.decode_s, seconds)
        if drafts is None:
            self.plain_s = ema(self.plain_s, seconds)
        else:  # making the guesses (a draft model's steps) is part of what they cost
            prior = self.prefill_token_s or DEFAULT_PREFILL_TOKEN_S
            guessed = drafts.slots * (drafts.width - 1)
            self.verify.add(guessed, seconds + drafts.made_s, prior)

    def guesses(self, rows: Sequence[Sequence[float]], running: int, slots: int) -> int:
        """How many guesses after its input token each row of a verify pass over `slots` rows
        (`running` of them streams) may feed: the number that makes the most tokens a second.
        `rows`: each guessing row's guesses kept on average if it guesses 0, 1, ... up to the
        most it wants.

        Every slot pays for the widest row's guesses, whichever rows keep theirs. On CPU, where
        the kernels made a decode step cheap, four rows guessing up to eight tokens each took
        5-10x a plain step and kept 3.5 tokens a row: 0.7x the plain steps' tokens a second.
        Until a plain step and a verify pass are measured, every row guesses what it wants; after
        PROBE_EVERY steps running without guesses, the best width of at least one is tried again
        (what a pass costs and how well rows guess change as they go, and are learnt from passes
        alone)."""
        most = max((len(kept) - 1 for kept in rows), default=0)
        if self.plain_s is None or self.verify.guess_s is None or not most:
            return most
        # A plain step costs no more than a verify pass without guesses (where the line's fixed
        # part is above nothing): measured once beside a slow step (a cache growing, a prefill's
        # memory), its average would stand while every step verifies.
        plain_s = self.plain_s
        if self.verify.fixed_s > 0:
            plain_s = min(plain_s, self.verify.fixed_s)
        rates = [running / plain_s]
        for width in range(1, most + 1):
            kept = sum(row[min(width, len(row) - 1)] for row in rows)
            rates.append((running + kept) / self.verify.seconds(slots * width))
        best = max(range(len(rates)), key=rates.__getitem__)
        self.unguessed = self.unguessed + 1 if best == 0 else 0
        if self.unguessed > PROBE_EVERY:
            self.unguessed = 0
            return max(range(1, len(rates)), key=rates.__getitem__)
        return best

    def passed(self, tokens: int, seconds: float, context: int) -> None:
        """A prefill pass over `tokens` (its rows times its columns) after `context` tokens
        already in its caches took `seconds`."""
        if tokens > 0 and context <= LINE_CONTEXT:
            self.passes.add(tokens, seconds)

    def prefill_plan(
        self, decoding: int, waiting: Sequence[Waiting], kv_room: int | None, now: float
    ) -> PrefillPlan:
        """The prefill of a step beside `decoding` streams, with `kv_room` bytes free for new
        prompts, at `now` (time.monotonic())."""
        allowance_s = self.allowance_s(decoding, [p.rest for p in waiting])
        ranked = sorted(waiting, key=lambda p: self.rank(p.rest, now - p.submitted_at))
        return PrefillPlan(
            self.budget(decoding, allowance_s),
            allowance_s,
            kv_room,
            [p.stream_id for p in ranked],
            self.prefill_token_s or DEFAULT_PREFILL_TOKEN_S,
            {p.stream_id: p.last_chunk for p in waiting if p.last_chunk is not None},
            self.passes.fixed_s,
        )

    @staticmethod
    def preemption_order(running: Iterable[tuple[int, float]]) -> list[int]:
        """Which decoding sequences (stream id, admitted at) give their caches back first when the
        KV memory budget runs short: the youngest; the oldest always goes on (a prompt that cannot
        fit alone was refused at admission)."""
        by_age = sorted(running, key=lambda row: row[1], reverse=True)
        return [stream_id for stream_id, _ in by_age[:-1]]

    def allowance_s(self, decoding: int, rests: Sequence[int]) -> float | None:
        """Seconds of prefill a step may add to decoding `decoding` streams while prompts with
        `rests` tokens left to prefill wait; None when nothing limits it."""
        s = self.settings
        if not decoding or s.step_token_budget or self.decode_s is None:
            return None
        step_s = self.decode_step_s(decoding)
        # The decoding streams' bound (a step at most max_step_ratio decode steps) holds while
        # few prompts wait; past it, the waiting prompts' claim.
        return max((s.max_step_ratio - 1.0) * step_s, self._waiting_claim_s(step_s, rests))

    def _waiting_claim_s(self, step_s: float, rests: Sequence[int]) -> float:
        """The waiting prompts' claim on a step whose decode takes `step_s`: each its prefill, up
        to a decode step (a long prompt claims no more than a step), and all of them together at
        most the geometric mean of the step's own cost and their whole prefill. That is how many
        a step starts when every step costs a decode and a pass besides its prompts: the first
        ones wait for fewer behind them, the last for fewer steps (a batch of k of W prompts that
        each take c, in steps costing s besides: the mean wait (W/k + 1)(s + kc)/2 is least at
        k = sqrt(Ws/c)). One a step, the last of a burst waited for twenty decode steps; all at
        once, the first of them waited for all the others' prefill."""
        costs = [self.passes.seconds(rest) for rest in rests]
        overhead_s = step_s + self.passes.fixed_s
        return min(sum(min(c, step_s) for c in costs), math.sqrt(overhead_s * sum(costs)))

    def decode_step_s(self, decoding: int) -> float:
        """What a decode step of `decoding` rows costs: its running average, but at least a
        prefill pass over as many tokens (the same weights and matmul rows), which the average
        lags behind when a burst's prompts have just joined (1 row to 14: 19 ms to 56 ms)."""
        assert self.decode_s is not None
        if self.passes.token_s is None:
            return self.decode_s
        return max(self.decode_s, self.passes.seconds(decoding))

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
        if allowance_s is None or not self.prefill_token_s:
            return s.min_prefill_chunk
        # One pass, at least, goes with the tokens.
        fits = (allowance_s - self.passes.fixed_s) / self.prefill_token_s
        return int(min(s.max_prefill_tokens, max(s.min_prefill_chunk, fits)))

    def chunk(self, budget: int, todo: int) -> int:
        """The next chunk of a prompt with `todo` tokens left, out of `budget` (a prompt not yet
        started, or any in a step with no time allowance): all of them if less than a minimum
        chunk would be left (a pass and a step of their own for a few tokens cost more than
        taking them now)."""
        s = self.settings
        chunk = min(budget, todo, s.max_prefill_chunk)
        if todo - chunk < s.min_prefill_chunk and todo <= s.max_prefill_chunk:
            return todo
        return chunk

    def steered_chunk(
        self, last_chunk: tuple[int, float], todo: int, allowance_s: float, fixed_s: float = 0.0
    ) -> int:
        """The next chunk of a prompt in prefill, sized from its own previous pass (`last_chunk`:
        its tokens and seconds, `fixed_s` of which any pass costs) to take about `allowance_s`.

        Past its fixed part a pass costs per token more as the prompt grows (its attention), which
        the line through all passes does not capture.
        """
        tokens, took = last_chunk
        fixed_s = min(fixed_s, 0.9 * took)
        steered = int(tokens * (allowance_s - fixed_s) / max(took - fixed_s, 1e-3))
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
