"""Repetition, presence and frequency penalties (engine/penalties.py) give mlx-lm's tokens: on
their own against mlx-lm's logits processors, and through the engine against `mlx_lm`'s greedy
generation with them, alone, batched beside rows with other penalties (or none), and with
speculation's verify passes guessing ahead. The repetition penalty counts the prompt's tokens
too, presence and frequency the reply's alone (OpenAI's definition)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import (
    make_frequency_penalty,
    make_presence_penalty,
    make_repetition_penalty,
)

from mlxgate.engine.contract import SamplingParams
from mlxgate.engine.penalties import Penalties, penalized
from support.tiny_engine import Oracle, Served, assert_same, guessing, prompts, reference
from support.tiny_models import VOCAB

STEPS = 40

# Each row's penalties, as SamplingParams and mlx-lm name them; strong enough to change tokens.
PENALTIES: list[dict[str, Any]] = [
    {"repetition_penalty": 1.5, "repetition_context_size": 16},
    {"frequency_penalty": 1.5, "frequency_context_size": 30},
    {"presence_penalty": 2.0, "presence_context_size": 8},
    {"repetition_penalty": 0.7, "presence_penalty": -0.5, "frequency_penalty": 0.8},
    {},
]


def processors(penalties: dict[str, Any], prompt_tokens: int) -> list[Any]:
    """mlx-lm's processors for `penalties`, in its order; presence and frequency given the
    tokens after the prompt's `prompt_tokens`."""
    made = []
    for name, make, reply in [
        ("repetition", make_repetition_penalty, False),
        ("presence", make_presence_penalty, True),
        ("frequency", make_frequency_penalty, True),
    ]:
        if penalties.get(f"{name}_penalty"):
            processor = make(
                penalties[f"{name}_penalty"], penalties.get(f"{name}_context_size", 20)
            )
            made.append(_reply_only(processor, prompt_tokens) if reply else processor)
    return made


def _reply_only(processor: Any, prompt_tokens: int) -> Any:
    return lambda tokens, logits: processor(tokens[prompt_tokens:], logits)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_a_batch_is_penalized_as_mlx_lm_penalizes_each_row(dtype: mx.Dtype) -> None:
    rng = np.random.default_rng(0)
    rows = len(PENALTIES)
    logits = mx.array(rng.normal(0, 3, (rows, VOCAB)).astype(np.float32)).astype(dtype)
    # Small vocabularies: many repeats, as a loop has. Prompts and replies shorter than the
    # windows and longer; a verify pass's guesses ahead of some rows' positions.
    prompts_ = [rng.integers(0, 12, size=n).tolist() for n in (10, 19, 5, 13, 40)]
    replies = [rng.integers(0, 12, size=n).tolist() for n in (0, 7, 12, 30, 3)]
    ahead = [[], [3, 3], [], [1], [7]]
    listed = []
    for i, p in enumerate(PENALTIES):
        penalties = Penalties.of(SamplingParams(**p), prompts_[i])
        if penalties is not None:
            penalties.seen(replies[i])
            listed.append((i, penalties, ahead[i]))
    ours = penalized(logits, listed)
    for i, p in enumerate(PENALTIES):
        theirs = logits[i : i + 1]
        for processor in processors(p, len(prompts_[i])):
            theirs = processor(mx.array([*prompts_[i], *replies[i], *ahead[i]]), theirs)
        assert ours.dtype == theirs.dtype
        assert mx.array_equal(ours[i : i + 1], theirs).item(), f"row {i}: {p}"


def test_a_penalty_of_zero_or_a_repetition_penalty_of_one_is_none() -> None:
    assert not SamplingParams(repetition_penalty=1.0).penalized
    assert not SamplingParams().penalized
    assert SamplingParams(frequency_penalty=-0.1).penalized
    assert Penalties.of(SamplingParams(), [1, 2, 3]) is None


@pytest.fixture(params=["llama", "qwen3_moe"])
def tiny(request: pytest.FixtureRequest) -> Iterator[tuple[Served, Any, Oracle]]:
    with guessing(request.param) as tiny:
        yield tiny


def test_penalized_rows_give_mlx_lms_tokens_alone_batched_and_guessed(
    tiny: tuple[Served, Any, Oracle],
) -> None:
    """Each row of a batch has other penalties (one has none); rows guess ahead from an oracle
    that knows mlx-lm's penalized tokens and spoils some, so a verify pass keeps all, some or
    none of a row's guesses, each position penalized as if the guesses before it were kept."""
    served, model, oracle = tiny
    many = prompts(len(PENALTIES), 3, 30, seed=31)
    expected = [
        reference(model, prompt, STEPS, logits_processors=processors(p, len(prompt)))
        for prompt, p in zip(many, PENALTIES, strict=True)
    ]
    plain = reference(model, many[0], STEPS)
    assert plain.tokens != expected[0].tokens, "the penalty changes nothing: a weak test"
    for prompt, want in zip(many, expected, strict=True):
        oracle.expect(prompt, want.tokens)
    metrics = served.engine.metrics

    def sampling(i: int) -> SamplingParams:
        return SamplingParams(**PENALTIES[i])

    alone = served.result(served.submit(many[0], STEPS, sampling=sampling(0)))[0]
    assert_same(alone, expected[0], "alone")
    readers = [served.submit(p, STEPS, sampling=sampling(i)) for i, p in enumerate(many)]
    for i, reader in enumerate(readers):
        assert_same(served.result(reader)[0], expected[i], f"row {i}: {PENALTIES[i]}")
    assert 0 < metrics.accepted_tokens < metrics.drafted_tokens
