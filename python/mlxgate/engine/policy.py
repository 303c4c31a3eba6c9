"""How much prefill each engine step does: the token budget, chunk sizes and prompt groups.

Pure arithmetic on the settings and on what the engine measures as it runs (the time of a
decode step and of one prefilled token); it never touches MLX, so its decisions are tested
alone (tests/test_policy.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from mlxgate.engine.settings import EngineSettings

# Prompts prefilled in one batched forward pass at most.
MAX_GROUP_ROWS = 32
# Weight of the newest sample in the running averages of step and prefill costs.
EMA_WEIGHT = 0.2
# How much a waiting prompt's wait counts against its prefill left (see `StepPolicy.rank`).
AGE_WEIGHT = 0.1
# The cost of a prefilled token before any is measured (SmolLM2-135M on 2 x86 cores: ~5 ms).
DEFAULT_PREFILL_TOKEN_S = 0.005


def ema(previous: float | None, sample: float, weight: float = EMA_WEIGHT) -> float:
    return sample if previous is None else previous + weight * (sample - previous)


@dataclass
class StepPolicy:
    """The prefill budget of each step, from what decode steps and prefill passes have cost."""

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
