"""The engine's scheduler alone: prefill plans, budgets, chunk sizes, prompt groups and the order
of preemption, without MLX."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlxgate.engine.scheduler import (
    DEFAULT_PREFILL_TOKEN_S,
    MAX_GROUP_ROWS,
    PROBE_EVERY,
    PassCost,
    PrefillPlan,
    Scheduler,
    VerifyCost,
    chunk_cost,
    ema,
)
from mlxgate.engine.settings import EngineSettings

SETTINGS = EngineSettings(
    max_step_ratio=3.0, max_prefill_tokens=2048, max_prefill_chunk=256, min_prefill_chunk=16
)


def measured(decode_s: float, prefill_token_s: float, pass_s: float = 0.0) -> Scheduler:
    """A policy that has seen decode steps and prefill passes of these costs."""
    return Scheduler(SETTINGS, decode_s, PassCost(pass_s, prefill_token_s))


def test_the_module_runs_without_mlx() -> None:
    modules = "sorted(m for m in sys.modules if 'mlx.' in m)"
    code = f"import sys, mlxgate.engine.scheduler; print({modules})"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_running_average_starts_at_its_first_sample_and_moves_a_fifth_of_the_way() -> None:
    assert ema(None, 0.5) == 0.5
    assert ema(1.0, 2.0) == pytest.approx(1.2)
    policy = Scheduler(SETTINGS)
    policy.decoded(0.1)
    policy.decoded(0.2)
    assert policy.decode_s == pytest.approx(0.12)


def test_a_pass_costs_a_fixed_part_and_a_part_per_token_fitted_to_the_passes() -> None:
    policy = Scheduler(SETTINGS)
    policy.passed(0, 1.0, 0)  # nothing computed: nothing learnt
    assert policy.prefill_token_s is None and policy.passes.fixed_s == 0.0
    # Passes of one size cannot tell the parts apart: all of it is per token.
    policy.passed(20, 0.05, 0)
    assert policy.passes.fixed_s == 0.0 and policy.prefill_token_s == pytest.approx(0.0025)
    # Nor can passes of sizes close together, however their times vary.
    cost = PassCost()
    for tokens, seconds in ((52, 0.6), (60, 0.5), (55, 0.7), (64, 0.55)):
        cost.add(tokens, seconds)
        assert cost.fixed_s == 0.0
    # 11 ms a pass, then 2 ms a token, over passes of 4 to 80 tokens.
    for tokens in (4, 16, 80, 30, 8, 64, 20, 40) * 4:
        policy.passed(tokens, 0.011 + 0.002 * tokens, context=80)
    assert policy.passes.fixed_s == pytest.approx(0.011, rel=0.05)
    assert policy.prefill_token_s == pytest.approx(0.002, rel=0.05)
    assert policy.passes.seconds(50) == pytest.approx(0.111, rel=0.05)
    # A long prompt's chunks deep into it are its own: the line stays.
    for tokens, seconds in ((52, 0.6), (60, 0.5), (55, 0.7), (64, 0.55)) * 3:
        policy.passed(tokens, seconds, context=8000)
    assert policy.passes.fixed_s == pytest.approx(0.011, rel=0.05)
    assert policy.prefill_token_s == pytest.approx(0.002, rel=0.05)


def test_a_prompts_next_chunk_is_sized_from_its_passes_averaged() -> None:
    assert chunk_cost(None, 50, 0.5) == (50, 0.5)
    # 40 tokens took 0.4 s before; 50 took 0.7 s now: 0.5 s scaled, averaged with 0.7.
    assert chunk_cost((40, 0.4), 50, 0.7) == (50, pytest.approx(0.6))


# A pass's time: none (a clock too coarse), or from a microsecond up; subnormal floats would
# divide to 0 and say nothing of the line.
PASS_SECONDS = st.one_of(st.just(0.0), st.floats(1e-6, 10.0))


@given(st.lists(st.tuples(st.integers(1, 4096), PASS_SECONDS), min_size=1))
def test_the_fitted_parts_are_never_negative_and_a_token_always_costs(
    passes: list[tuple[int, float]],
) -> None:
    cost = PassCost()
    for tokens, seconds in passes:
        cost.add(tokens, seconds)
        assert cost.fixed_s >= 0.0 and cost.token_s is not None and cost.token_s >= 0.0
    if any(seconds > 0 for _, seconds in passes[-1:]):
        assert cost.token_s is not None and cost.token_s > 0.0


def test_with_nothing_decoding_a_step_prefills_all_it_may() -> None:
    policy = measured(decode_s=0.1, prefill_token_s=0.001)
    assert policy.allowance_s(decoding=0, rests=[50] * 3) is None
    assert policy.budget(decoding=0, allowance_s=None) == 2048


def test_before_any_measurement_a_step_beside_decoding_prefills_the_minimum_chunk() -> None:
    policy = Scheduler(SETTINGS)
    assert policy.allowance_s(decoding=4, rests=[500]) is None
    assert policy.budget(decoding=4, allowance_s=None) == 16
    policy.decoded(0.1)  # a decode step measured, no prefill yet
    allowance = policy.allowance_s(decoding=4, rests=[500])
    assert allowance == pytest.approx(0.2)
    assert policy.budget(decoding=4, allowance_s=allowance) == 16


def test_the_budget_fills_the_allowance_at_the_measured_rate() -> None:
    # A step may take 3x a decode step: 0.2 s of prefill at 1 ms a token.
    policy = measured(decode_s=0.1, prefill_token_s=0.001)
    allowance = policy.allowance_s(decoding=4, rests=[500])
    assert allowance == pytest.approx(0.2)
    assert policy.budget(decoding=4, allowance_s=allowance) == 200


def test_each_waiting_prompt_claims_its_own_prefill_up_to_a_decode_step() -> None:
    policy = measured(decode_s=0.1, prefill_token_s=0.002, pass_s=0.01)
    # A burst's last prompts beside twenty streams (30 tokens: 70 ms each), where two decode
    # steps a decoding stream, each, would give them 100 ms in all. A few: the streams' bound.
    assert policy.allowance_s(decoding=20, rests=[30] * 3) == pytest.approx(0.2)
    # Ten claim the geometric mean of a step's own cost (a decode step and a pass's fixed part:
    # 110 ms) and their whole prefill (0.7 s): about four prompts' worth.
    assert policy.allowance_s(decoding=20, rests=[30] * 10) == pytest.approx(math.sqrt(0.11 * 0.7))
    # Longer prompts claim a decode step each, within the same bound.
    assert policy.allowance_s(decoding=20, rests=[300] * 4) == pytest.approx(0.4)
    assert policy.allowance_s(decoding=20, rests=[300] * 10) == pytest.approx(math.sqrt(0.11 * 6.1))
    # A long prompt alone claims one step: the decoding streams' bound holds.
    assert policy.allowance_s(decoding=20, rests=[12_000]) == pytest.approx(0.2)


def test_a_decode_step_costs_at_least_a_prefill_pass_over_its_rows() -> None:
    # The average still says 20 ms (one row decoded); 14 rows joined since: 11 + 14 x 2 ms.
    policy = measured(decode_s=0.02, prefill_token_s=0.002, pass_s=0.011)
    assert policy.decode_step_s(1) == pytest.approx(0.02)
    assert policy.decode_step_s(14) == pytest.approx(0.039)
    assert policy.allowance_s(decoding=14, rests=[20]) == pytest.approx(2 * 0.039)


def test_the_budget_leaves_a_pass_fixed_part_out_of_the_allowance() -> None:
    # 0.2 s: 20 ms for the pass, 0.18 s of tokens at 2 ms.
    policy = measured(decode_s=0.1, prefill_token_s=0.002, pass_s=0.02)
    assert policy.budget(decoding=4, allowance_s=0.2) == 90


def test_the_budget_stays_between_the_minimum_chunk_and_the_most_tokens() -> None:
    assert measured(decode_s=0.1, prefill_token_s=1e-6).budget(4, 0.2) == 2048
    assert measured(decode_s=0.1, prefill_token_s=0.1).budget(4, 0.2) == 16


def test_a_fixed_step_budget_leaves_one_token_per_decoding_stream() -> None:
    policy = Scheduler(EngineSettings(step_token_budget=512, min_prefill_chunk=16))
    policy.decoded(0.1)
    assert policy.allowance_s(decoding=12, rests=[50] * 40) is None
    assert policy.budget(decoding=12, allowance_s=None) == 500
    assert policy.budget(decoding=510, allowance_s=None) == 16
    assert policy.budget(decoding=0, allowance_s=None) == 2048


def test_a_plain_chunk_is_the_least_of_budget_prompt_rest_and_chunk_size() -> None:
    policy = Scheduler(SETTINGS)
    assert policy.chunk(budget=1000, todo=1000) == 256
    assert policy.chunk(budget=100, todo=1000) == 100
    assert policy.chunk(budget=1000, todo=40) == 40


def test_a_chunk_takes_the_whole_rest_rather_than_leave_less_than_a_minimum_chunk() -> None:
    policy = Scheduler(SETTINGS)
    assert policy.chunk(budget=30, todo=40) == 40  # 10 left: not worth a pass of its own
    assert policy.chunk(budget=24, todo=40) == 24  # 16 left: a pass of its own
    assert policy.chunk(budget=250, todo=260) == 250  # past a chunk's size: never whole
    # A prompt in prefill beside decoding streams keeps to its allowance: its last tokens are
    # a step of their own.
    assert policy.steered_chunk((20, 0.05), todo=30, allowance_s=0.05) == 20


def test_a_steered_chunk_scales_the_last_pass_to_the_allowance() -> None:
    policy = Scheduler(SETTINGS)
    # 100 tokens took 0.1 s; 0.15 s allowed: 150 tokens.
    assert policy.steered_chunk((100, 0.1), todo=5000, allowance_s=0.15) == 150
    # At most twice, at least half the last chunk.
    assert policy.steered_chunk((100, 0.1), todo=5000, allowance_s=1.0) == 200
    assert policy.steered_chunk((100, 0.1), todo=5000, allowance_s=0.01) == 50
    # Never under the minimum chunk, over the chunk size or past the prompt's end.
    assert policy.steered_chunk((20, 0.1), todo=5000, allowance_s=0.01) == 16
    assert policy.steered_chunk((200, 0.1), todo=5000, allowance_s=1.0) == 256
    assert policy.steered_chunk((100, 0.1), todo=30, allowance_s=0.15) == 30
    # A pass timed at zero counts as a millisecond.
    assert policy.steered_chunk((100, 0.0), todo=5000, allowance_s=0.00075) == 75
    # The fixed part of a pass does not scale: 100 tokens took 20 ms + 0.1 s, 0.17 s allowed.
    assert policy.steered_chunk((100, 0.12), 5000, allowance_s=0.17, fixed_s=0.02) == 150


def test_short_prompts_that_fit_together_make_a_group() -> None:
    policy = Scheduler(SETTINGS)
    assert policy.group([40, 36, 44, 38], budget=2048, room=64) == [40, 36, 44, 38]
    assert policy.group(iter([40, 36]), budget=2048, room=64) == [40, 36]


def test_a_group_needs_two_prompts() -> None:
    policy = Scheduler(SETTINGS)
    assert policy.group([40], budget=2048, room=64) == []
    assert policy.group([40, None, 30], budget=2048, room=64) == []
    assert policy.group([], budget=2048, room=64) == []


def test_a_group_ends_at_the_first_prompt_that_cannot_join() -> None:
    policy = Scheduler(SETTINGS)
    # Started already or with several choices (None), nothing left, longer than a chunk.
    assert policy.group([40, 30, None, 30], budget=2048, room=64) == [40, 30]
    assert policy.group([40, 30, 0, 30], budget=2048, room=64) == [40, 30]
    assert policy.group([40, 30, 257, 30], budget=2048, room=64) == [40, 30]
    assert policy.group([256, 256], budget=2048, room=64) == [256, 256]


def test_padding_stays_under_a_quarter_of_a_groups_work() -> None:
    policy = Scheduler(SETTINGS)
    # 100 and 80: 200 padded for 180 of work; adding 20 would pad 300 for 200.
    assert policy.group([100, 80, 20, 100], budget=2048, room=64) == [100, 80]
    assert policy.group([100, 50], budget=2048, room=64) == []


def test_a_group_fits_the_budget_and_the_room_in_the_batch() -> None:
    policy = Scheduler(SETTINGS)
    assert policy.group([100, 100, 100], budget=250, room=64) == [100, 100]
    assert policy.group([100, 100, 100], budget=2048, room=2) == [100, 100]
    assert len(policy.group([10] * 100, budget=4096, room=64)) == MAX_GROUP_ROWS


@given(
    decode_s=st.floats(1e-4, 10.0),
    prefill_token_s=st.floats(1e-7, 1.0),
    decoding=st.integers(1, 64),
    rests=st.lists(st.integers(1, 20_000), max_size=64),
)
def test_beside_decoding_streams_the_budget_is_always_within_bounds(
    decode_s: float, prefill_token_s: float, decoding: int, rests: list[int]
) -> None:
    policy = measured(decode_s, prefill_token_s)
    allowance = policy.allowance_s(decoding, rests)
    assert allowance is not None and allowance >= 2.0 * decode_s * (1 - 1e-12)
    assert 16 <= policy.budget(decoding, allowance) <= 2048


@given(
    tokens=st.integers(1, 256),
    took=st.floats(0.0, 10.0),
    todo=st.integers(1, 10_000),
    allowance_s=st.floats(0.0, 10.0),
)
def test_a_steered_chunk_never_overruns_the_prompt_or_the_chunk_size(
    tokens: int, took: float, todo: int, allowance_s: float
) -> None:
    chunk = Scheduler(SETTINGS).steered_chunk((tokens, took), todo, allowance_s)
    assert 1 <= chunk <= min(todo, 256)
    assert chunk == todo or chunk >= 16


def test_the_least_prefill_left_goes_first_and_a_long_wait_counts_a_tenth() -> None:
    policy = measured(decode_s=0.1, prefill_token_s=0.01)
    # A 100-token turn goes before a 12k-token prompt that has waited two minutes.
    assert policy.rank(100, waited_s=0.0) < policy.rank(12_000, waited_s=120.0)
    # Among prompts alike, the one that waited longer.
    assert policy.rank(100, waited_s=5.0) < policy.rank(100, waited_s=1.0)
    # A long prompt that waited ten times its rest's prefill goes before a new short one.
    assert policy.rank(1_000, waited_s=101.0) < policy.rank(1, waited_s=0.0)


@dataclass
class Prompt:
    """A waiting prompt as the scheduler reads it."""

    stream_id: int
    rest: int
    submitted_at: float
    last_chunk: tuple[int, float] | None = None


def test_a_prefill_plan_serves_the_least_left_first_and_carries_each_prompts_last_pass() -> None:
    scheduler = measured(decode_s=0.1, prefill_token_s=0.01)
    waiting = [
        Prompt(1, rest=12_000, submitted_at=0.0, last_chunk=(256, 0.5)),  # prefilling for 60 s
        Prompt(2, rest=100, submitted_at=55.0),
        Prompt(3, rest=100, submitted_at=50.0),
    ]
    plan = scheduler.prefill_plan(decoding=4, waiting=waiting, kv_room=1 << 20, now=60.0)
    assert plan.order == [3, 2, 1]
    assert plan.last_chunks == {1: (256, 0.5)}
    assert plan.kv_room == 1 << 20
    # Each waiting prompt claims a decode step (its own prefill is longer).
    assert plan.allowance_s == pytest.approx(0.3)
    assert plan.budget == 30
    assert plan.token_s == 0.01
    assert plan.pass_s == 0.0


def test_with_nothing_decoding_a_prefill_plan_has_no_time_limit() -> None:
    plan = Scheduler(SETTINGS).prefill_plan(0, [Prompt(7, 50, 0.0)], kv_room=None, now=1.0)
    assert plan.allowance_s is None and plan.left_s(spent_s=10.0) is None
    assert plan.budget == 2048 and plan.order == [7]
    # Before any prefill is measured, a token is costed at the default rate.
    assert plan.token_s == DEFAULT_PREFILL_TOKEN_S


def test_the_allowance_left_counts_the_passes_and_tokens_a_step_has_spent() -> None:
    plan = PrefillPlan(100, 0.2, None, [], token_s=0.001, pass_s=0.01)
    assert plan.left_s(spent_s=0.0) == pytest.approx(0.2)
    assert plan.cost_s(150) == pytest.approx(0.16)
    assert plan.left_s(plan.cost_s(150)) == pytest.approx(0.04)
    assert plan.left_s(plan.cost_s(300, passes=2)) == pytest.approx(-0.12)


def test_the_youngest_sequences_are_preempted_first_and_the_oldest_never() -> None:
    running = [(10, 3.0), (11, 1.0), (12, 5.0), (13, 2.0)]  # (stream id, admitted at)
    assert Scheduler.preemption_order(running) == [12, 10, 13]
    assert Scheduler.preemption_order([(10, 3.0)]) == []
    assert Scheduler.preemption_order([]) == []


def test_a_verify_pass_costs_a_fixed_part_and_a_part_per_guess_fitted_to_the_passes() -> None:
    cost = VerifyCost()
    for guessed in [1, 3, 5, 7, 2, 8, 4]:  # one row: a 17 ms step and 2.5 ms a guess
        cost.add(guessed, 0.017 + 0.0025 * guessed, prior_guess_s=0.002)
    assert cost.fixed_s == pytest.approx(0.017) and cost.guess_s == pytest.approx(0.0025)
    assert cost.seconds(4) == pytest.approx(0.027)


def test_verify_passes_of_one_width_keep_a_guess_cost_and_move_the_fixed_part() -> None:
    cost = VerifyCost()
    for _ in range(10):
        cost.add(4, 0.047, prior_guess_s=0.002)  # four rows guessing one each
    # Through one width the line cannot tell a guess from the pass: a guess keeps the prior cost.
    assert cost.guess_s == pytest.approx(0.002)
    assert cost.fixed_s == pytest.approx(0.039)
    for _ in range(10):
        cost.add(4, 0.067, prior_guess_s=0.002)  # the context grew
    assert cost.guess_s == pytest.approx(0.002)
    assert cost.fixed_s == pytest.approx(0.059, rel=0.05)


def geometric(wanted: int, p: float) -> list[float]:
    """The guesses a row keeps on average for 0, 1, ... `wanted` guesses, each kept with chance
    `p` where the one before it was."""
    return [sum(p**i for i in range(1, width + 1)) for width in range(wanted + 1)]


def verifying(plain_s: float, fixed_s: float, guess_s: float) -> Scheduler:
    """A scheduler that has seen plain decode steps and verify passes of these costs."""
    policy = Scheduler(SETTINGS, plain_s=plain_s)
    policy.verify = VerifyCost(fixed_s, guess_s)
    return policy


def test_before_a_verify_pass_is_measured_every_row_guesses_what_it_wants() -> None:
    policy = Scheduler(SETTINGS)
    assert policy.guesses([geometric(4, 0.5), geometric(2, 0.5)], running=2, slots=2) == 4
    policy.decoded(0.017)  # a plain step alone prices no guess
    assert policy.guesses([geometric(4, 0.5)], running=1, slots=1) == 4
    assert policy.guesses([], running=1, slots=1) == 0


def test_a_verify_pass_is_as_wide_as_makes_the_most_tokens_a_second() -> None:
    # One row that keeps nearly every guess: guessing is cheap against its step, so all of them.
    one = verifying(plain_s=0.017, fixed_s=0.018, guess_s=0.0025)
    assert one.guesses([geometric(8, 0.95)], running=1, slots=1) == 8
    # A row that keeps few: a guess is not worth its position.
    assert one.guesses([geometric(8, 0.1)], running=1, slots=1) == 0
    # Four rows (measured: a plain step 26 ms, a verify pass ~30 ms and 5 ms a position): at
    # eight guesses a row the pass costs 6x a plain step for 4.7 more tokens a row; fewer pay.
    four = verifying(plain_s=0.026, fixed_s=0.030, guess_s=0.005)
    rows = [geometric(8, 0.9)] * 4
    width = four.guesses(rows, running=4, slots=4)
    assert 1 <= width < 8

    def rate(w: int) -> float:
        kept = sum(row[w] for row in rows)
        return (4 + kept) / (four.verify.seconds(4 * w) if w else 0.026)

    assert rate(width) == max(rate(w) for w in range(9))
    # Slots of a free row pay for the guesses too.
    assert four.guesses([rows[0]], running=1, slots=4) < four.guesses([rows[0]], 1, 1)


def test_a_row_that_stopped_guessing_is_tried_again() -> None:
    policy = verifying(plain_s=0.017, fixed_s=0.030, guess_s=0.003)
    row = geometric(3, 0.4)
    widths = [policy.guesses([row], running=1, slots=1) for _ in range(3 * PROBE_EVERY)]
    tried = [step for step, width in enumerate(widths) if width]
    assert tried == [PROBE_EVERY, 2 * PROBE_EVERY + 1]
    # The best width of one or more: two guesses (1.56 tokens in 36 ms; one: 1.4 in 33 ms).
    assert widths[PROBE_EVERY] == 2


@dataclass
class Guesses:
    """A verify pass's guesses, as the scheduler reads them."""

    slots: int
    width: int
    made_s: float = 0.0


def test_decode_steps_price_plain_steps_and_verify_passes_apart() -> None:
    policy = Scheduler(SETTINGS, passes=PassCost(0.011, 0.001))  # a prefilled token: 1 ms
    policy.decoded(0.020)
    for guesses in [1, 8, 2, 7, 4]:
        # Half the time in the pass, half in making the guesses (a draft model).
        policy.decoded(0.011 + 0.002 * guesses, Guesses(2, guesses + 1, 0.011 + 0.002 * guesses))
    assert policy.plain_s == pytest.approx(0.020)
    assert policy.verify.guess_s == pytest.approx(0.002)  # a guessed position, of two slots
    assert policy.verify.fixed_s == pytest.approx(0.022)
    # Every step, the guessing left out, for the allowance.
    expected = None
    for seconds in [0.020, *(0.011 + 0.002 * g for g in [1, 8, 2, 7, 4])]:
        expected = ema(expected, seconds)
    assert policy.decode_s == pytest.approx(expected)


def test_a_plain_step_costs_no_more_than_a_verify_pass_without_guesses() -> None:
    # A plain step measured once at 48 ms (beside a cache's growth), verify passes since at 25 ms
    # and 5 ms a guessed position: at 48 ms every width would seem to pay.
    stale = verifying(plain_s=0.048, fixed_s=0.025, guess_s=0.005)
    assert stale.guesses([geometric(6, 0.75)] * 4, running=4, slots=4) == 0


def test_a_guess_costs_at_least_a_prefilled_token() -> None:
    # One row's passes, their times varying: the line's slope alone would be near nothing.
    policy = Scheduler(SETTINGS, passes=PassCost(0.011, 0.0025))
    for guesses, seconds in [(1, 0.030), (8, 0.031), (2, 0.024), (7, 0.029), (4, 0.033)]:
        policy.decoded(seconds, Guesses(1, guesses + 1))
    assert policy.verify.guess_s == pytest.approx(0.0025)
    assert policy.verify.seconds(0) < 0.025
