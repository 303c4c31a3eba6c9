"""Repetition, presence and frequency penalties: each row's logits pushed away from the tokens it
has just seen, as mlx-lm's logits processors push them (`mlx_lm.sample_utils`'s
`make_logits_processors`, which `mlx_lm.generate` and `mlx_lm.server` use), for a whole batch at
once.

Each penalty counts the last `*_context_size` tokens: the repetition penalty of the prompt and
reply (as mlx-lm and llama.cpp count it), the presence and frequency penalties of the reply alone
(OpenAI's definition, as vLLM counts them: a reply that repeats nothing is left alone). In
mlx-lm's order and arithmetic, so a row's tokens equal mlx-lm's processors given those tokens:
- repetition (multiplicative, sign-aware): a seen token's logit divided by the penalty if
  positive, multiplied by it if negative;
- presence: the penalty subtracted once from a seen token's logit;
- frequency: subtracted once for every time the token was seen.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import mlx.core as mx

from mlxgate.engine.contract import SamplingParams


class Penalties:
    """One sequence's penalties and the recent tokens they count."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int]) -> None:
        repetition = params.repetition_penalty if params.repetition_penalty != 1.0 else 0.0
        self.repetition = (repetition, params.repetition_context_size)
        self.presence = (params.presence_penalty, params.presence_context_size)
        self.frequency = (params.frequency_penalty, params.frequency_context_size)
        held = max(size for penalty, size in self._active())
        self.recent: deque[int] = deque(prompt_ids[-held:] if held else (), maxlen=held)
        self.replied = 0  # tokens of the reply so far

    @staticmethod
    def of(params: SamplingParams, prompt_ids: Sequence[int]) -> Penalties | None:
        """The penalties `params` ask for, or None if they ask for none."""
        return Penalties(params, prompt_ids) if params.penalized else None

    def _active(self) -> list[tuple[float, int]]:
        return [(p, size) for p, size in (self.repetition, self.presence, self.frequency) if p]

    def seen(self, tokens: Sequence[int]) -> None:
        """The sequence went on with `tokens`."""
        self.recent.extend(tokens)
        self.replied += len(tokens)

    def window(self, size: int, ahead: Sequence[int] = (), reply: bool = False) -> list[int]:
        """The last `size` tokens (of the `reply` alone, or of prompt and reply), as if the
        sequence had gone on with `ahead` (a verify pass's guesses before the position it
        samples)."""
        tokens = [*self.recent, *ahead]
        if reply:
            size = min(size, self.replied + len(ahead))
        return tokens[-size:] if size else []


def penalized(logits: mx.array, rows: Sequence[tuple[int, Penalties, Sequence[int]]]) -> mx.array:
    """`logits` [rows, vocab] with each listed row's penalties applied: `(row, its penalties,
    tokens ahead of its recent ones)` (see `Penalties.window`)."""
    if not rows:
        return logits
    logits, dtype = mx.array(logits), logits.dtype  # (assigned into below: the caller's stays)
    # Repetition, then presence, then frequency (mlx-lm's order), each over its own window.
    r, c, factor = _entries(rows, lambda p: p.repetition, reply=False)
    if r:
        index = (mx.array(r), mx.array(c))
        chosen = logits[index]
        factor_array = mx.array(factor, dtype=dtype)
        logits[index] = mx.where(chosen < 0, chosen * factor_array, chosen / factor_array)
    r, c, amount = _entries(rows, lambda p: p.presence, reply=True)
    if r:
        index = (mx.array(r), mx.array(c))
        logits[index] = logits[index] - mx.array(amount, dtype=dtype)
    r, c, amount = _entries(rows, lambda p: p.frequency, reply=True)
    if r:
        # Scattered with repeats: once per time a token was seen, as mlx-lm subtracts it.
        logits = logits.at[mx.array(r), mx.array(c)].subtract(mx.array(amount, dtype=dtype))
    return logits


def _entries(
    rows: Sequence[tuple[int, Penalties, Sequence[int]]],
    which: Callable[[Penalties], tuple[float, int]],
    reply: bool,
) -> tuple[list[int], list[int], list[float]]:
    """One (row, token, penalty) entry per token in each row's window of the penalty `which`
    picks (of its `reply` alone, or of prompt and reply), repeats included."""
    r: list[int] = []
    c: list[int] = []
    values: list[float] = []
    for row, penalties, ahead in rows:
        penalty, size = which(penalties)
        if not penalty:
            continue
        tokens = penalties.window(size, ahead, reply)
        r.extend([row] * len(tokens))
        c.extend(tokens)
        values.extend([penalty] * len(tokens))
    return r, c, values
