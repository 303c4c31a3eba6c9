"""Speculative decoding: guessed tokens checked in the running batch change no token.

Tiny random-weight models (support/tiny_models.py) served by the real engine. Their guesses come
from an oracle that knows mlx-lm's greedy output and spoils some of it on purpose, so that every
verify pass mixes rows that keep all, some and none of their guesses; the tokens must still be
mlx-lm's, token for token (up to a tie, as in test_architectures). Prompt lookup itself is
tested on its own and with the embedded model in test_engine.py.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
from mlxgate._native import Reply, StreamSpec
from mlxgate.engine import GenerationRequest
from mlxgate.engine.cache_kinds import UnsupportedCache
from mlxgate.engine.contract import SamplingParams
from mlxgate.engine.speculation import Lookup, Speculation, continuation
from support.forced import forced_model_dir, serve_args
from support.servers import REPO, free_port, start_server, stop_server
from support.tiny_engine import (
    Oracle,
    Served,
    assert_same,
    guessing,
    prompts,
    reference,
    wait_until,
)
from support.tiny_models import build, quantized, twins

STEPS = 24


TARGETS = [
    ("llama", None),
    ("llama", "affine"),
    ("deepseek_v3", None),  # multi-head latent attention
    ("qwen3_moe", None),
    ("gemma2", None),  # decodes one sequence at a time (mlx-lm batches it wrong)
    ("gemma3_text", None),  # sliding windows of 8 tokens: rotated while prompts and replies run
    ("gpt_oss", None),  # sliding windows with attention sinks
    ("qwen3_next", None),  # gated delta layers: recurrent states restored from the pass's record
    ("qwen3_5", None),
]
# A draft model's own layers are plain attention (engine/drafter.py): these are drafted for by
# a draft model of another family only (test_a_draft_model_of_another_family_guesses_too).
NOT_CUTTABLE = {"gemma3_text", "gpt_oss", "qwen3_next", "qwen3_5"}


@pytest.fixture(params=TARGETS, ids=lambda p: p[0] if p[1] is None else f"{p[0]}-4bit")
def tiny(request: pytest.FixtureRequest) -> Iterator[tuple[Served, Any, Oracle]]:
    # Every row guesses, however many decode: verify passes of 16 rows at once.
    with guessing(*request.param) as tiny:
        yield tiny


def test_guessed_tokens_change_no_greedy_token(tiny: tuple[Served, Any, Oracle]) -> None:
    served, model, oracle = tiny
    many = prompts(16, 3, 40, seed=11)
    expected = [reference(model, p, STEPS) for p in many]
    for prompt, want in zip(many, expected, strict=True):
        oracle.expect(prompt, want.tokens)
    metrics = served.engine.metrics

    tokens, _ = served.generate(many[0], STEPS)
    assert_same(tokens, expected[0], "alone")
    assert metrics.accepted_tokens > 0 and metrics.verify_passes < STEPS

    readers = [served.submit(p, STEPS) for p in many]
    for i, reader in enumerate(readers):
        assert_same(served.result(reader)[0], expected[i], f"row {i} of 16")
    # Spoilt guesses were taken back, right ones kept.
    assert 0 < metrics.accepted_tokens < metrics.drafted_tokens


def test_a_stop_sequence_inside_a_kept_guess_ends_the_stream_there(
    tiny: tuple[Served, Any, Oracle],
) -> None:
    served, model, oracle = tiny
    prompt = prompts(1, 8, 9, seed=12)[0]
    want = reference(model, prompt, STEPS).tokens
    oracle.expect(prompt, want)
    # The vocabulary's token i reads "i,": stop at the 3rd and 4th tokens, which the first
    # verify pass guesses right.
    oracle.spoil = 1000
    stop = f"{want[2]},{want[3]},"
    spec = StreamSpec.anthropic(
        model="tiny",
        message_id="msg_s",
        stream=False,
        stop_sequences=[stop],
        reply=Reply(eos_ids=[]),
    )
    text_before = "".join(f"{t}," for t in want)
    cut = text_before.index(stop)
    reader = served.engine.admit(GenerationRequest(prompt, spec, STEPS))
    tokens, _ = served.result(reader)
    assert "".join(f"{t}," for t in tokens) == text_before[:cut]
    assert served.engine.metrics.accepted_tokens >= 3


def test_cancelling_a_stream_between_verify_passes_leaves_the_others_exact(
    tiny: tuple[Served, Any, Oracle],
) -> None:
    served, model, oracle = tiny
    engine = served.engine
    others = prompts(3, 5, 30, seed=13)
    expected = [reference(model, p, 60) for p in others]
    for prompt, want in zip(others, expected, strict=True):
        oracle.expect(prompt, want.tokens)
    readers = [served.submit(p, 60) for p in others]
    cancelled = served.submit(prompts(1, 10, 11, seed=14)[0], steps=1000)
    passes = engine.metrics.verify_passes
    wait_until(lambda: engine.metrics.verify_passes > passes + 2, engine)
    cancelled.cancel()
    for i, reader in enumerate(readers):
        assert_same(served.result(reader)[0], expected[i], f"row {i}")


@pytest.fixture(params=[arch for arch, q in TARGETS if q is None and arch not in NOT_CUTTABLE])
def drafted(request: pytest.FixtureRequest) -> Iterator[tuple[Served, Any]]:
    """A target served with a draft model: its own weights quantized to 4 bits, whose guesses
    are right often and wrong often (rows keep all, some or none of them in one pass)."""
    arch = request.param
    served_model, reference_model = twins(arch)
    draft = build(arch)
    draft.update(served_model.parameters())
    served = Served(
        served_model,
        draft_model=quantized(draft, arch),
        max_prefill_chunk=16,
        speculation_max_rows=64,
        prefix_cache_mb=64,
    )
    yield served, reference_model
    served.engine.stop()


def test_a_draft_model_changes_no_greedy_token(drafted: tuple[Served, Any]) -> None:
    served, model = drafted
    many = prompts(16, 3, 40, seed=21)
    expected = [reference(model, p, STEPS) for p in many]
    metrics = served.engine.metrics

    assert_same(served.generate(many[0], STEPS)[0], expected[0], "alone")
    assert metrics.accepted_tokens > 0 and metrics.verify_passes < STEPS

    readers = [served.submit(p, STEPS) for p in many]
    for i, reader in enumerate(readers):
        assert_same(served.result(reader)[0], expected[i], f"row {i} of 16")
    assert 0 < metrics.accepted_tokens < metrics.drafted_tokens
    # Each sequence's prompt is in the draft's prefix cache: a second turn reuses it.
    speculation = served.engine.speculation
    assert speculation is not None
    draft = speculation.draft_model
    assert draft is not None
    assert len(draft.prefix_cache) > 0
    longer = [*many[1], *expected[1].tokens, 5, 6]
    assert_same(served.generate(longer, STEPS)[0], reference(model, longer, STEPS), "next turn")


@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma3_text", "qwen3_5"])
def test_a_draft_model_of_another_family_guesses_too(arch: str) -> None:
    """Any model with the served model's tokenizer: here a llama guesses for a qwen3_moe, a
    windowed gemma3 or a recurrent qwen3_5 (its guesses are seldom right: rows keep some and not
    others), and the draft's rows follow the batch's joins and ends."""
    served_model, model = twins(arch)
    served = Served(served_model, draft_model=build("llama", seed=7), speculation_max_rows=64)
    try:
        many = prompts(6, 3, 30, seed=22)
        lengths = [8, 30, 3, 17, 24, 12]
        readers = [served.submit(p, n) for p, n in zip(many, lengths, strict=True)]
        for i, reader in enumerate(readers):
            want = reference(model, many[i], lengths[i])
            assert_same(served.result(reader)[0], want, f"row {i}")
        assert served.engine.metrics.drafted_tokens > 0
    finally:
        served.engine.stop()


@pytest.mark.parametrize("arch", ["nemotron_h", "lfm2"])  # Mamba, short convolutions
def test_speculation_is_off_where_a_layer_cannot_take_positions_back(arch: str) -> None:
    served = Served(twins(arch)[0])
    try:
        assert served.engine.speculation is None
    finally:
        served.engine.stop()


def _chi_square_critical(dof: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability ~0.001 (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def test_sampling_with_guesses_keeps_the_distribution() -> None:
    """Two tokens sampled at temperature 1 over the 4 likeliest (top-k): the pairs' counts fit
    the model's own probabilities, with guesses that are right about half the time."""
    import mlx.core as mx

    served_model, model = twins("llama")
    served = Served(served_model, speculation_max_rows=64)
    prompt = [5, 17, 3, 99, 42]
    top_k = 4

    def top(logits: mx.array) -> dict[int, float]:
        values = np.array(logits.astype(mx.float32))
        best = np.argsort(-values)[:top_k]
        p = np.exp(values[best] - values[best].max())
        return dict(zip(best.tolist(), (p / p.sum()).tolist(), strict=True))

    first = top(model(mx.array([prompt]))[0, -1])
    expected = {
        (a, b): pa * pb
        for a, pa in first.items()
        for b, pb in top(model(mx.array([[*prompt, a]]))[0, -1]).items()
    }
    likeliest = max(first, key=first.__getitem__)
    then = max((pair for pair in expected if pair[0] == likeliest), key=expected.__getitem__)
    assert served.engine.speculation is not None
    # Guesses the likeliest pair: both kept, the first only, or neither.
    served.engine.speculation.propose = lambda tokens, k: np.array(
        [likeliest, then[1]][len(tokens) - len(prompt) :], dtype=np.int64
    )[:k]
    spec = StreamSpec.anthropic(model="tiny", message_id="m", stream=False, reply=Reply(eos_ids=[]))
    sampling = SamplingParams(temperature=1.0, top_k=top_k)
    counts: Counter[tuple[int, int]] = Counter()
    rounds, per_round = 40, 64
    try:
        for _ in range(rounds):
            readers = [
                served.engine.admit(GenerationRequest(prompt, spec, 2, sampling))
                for _ in range(per_round)
            ]
            counts.update(tuple(served.result(r)[0]) for r in readers)  # type: ignore[misc]
    finally:
        served.engine.stop()
    n = rounds * per_round
    metrics = served.engine.metrics
    assert metrics.accepted_tokens > 0 and metrics.accepted_tokens < metrics.drafted_tokens
    assert set(counts) <= set(expected)
    cells = [pair for pair in expected if expected[pair] * n >= 5]
    rest = n - sum(counts[pair] for pair in cells)
    rest_p = 1 - sum(expected[pair] for pair in cells)
    chi2 = sum((counts[c] - n * expected[c]) ** 2 / (n * expected[c]) for c in cells)
    if rest_p * n >= 5:
        chi2 += (rest - n * rest_p) ** 2 / (n * rest_p)
        cells.append((-1, -1))
    assert chi2 < _chi_square_critical(len(cells) - 1), (chi2, counts, expected)


def test_a_seed_gives_the_same_tokens_with_guesses_or_without() -> None:
    served_model, _ = twins("llama")
    served = Served(served_model, speculation_max_rows=64, prefix_cache_mb=0)
    spec = StreamSpec.anthropic(model="tiny", message_id="m", stream=False, reply=Reply(eos_ids=[]))
    prompt = [7, 7, 8, 9, 10]
    sampling = SamplingParams(temperature=0.8, seed=1234)
    try:
        assert served.engine.speculation is not None
        plain = served.engine.speculation.propose
        served.engine.speculation.propose = lambda tokens, k: np.zeros(0, dtype=np.int64)
        want = served.result(served.engine.admit(GenerationRequest(prompt, spec, 30, sampling)))[0]
        oracle = Oracle(spoil=4)
        oracle.expect(prompt, want)
        served.engine.speculation.propose = oracle
        got = served.result(served.engine.admit(GenerationRequest(prompt, spec, 30, sampling)))[0]
        served.engine.speculation.propose = plain
    finally:
        served.engine.stop()
    assert got == want
    assert served.engine.metrics.accepted_tokens > 10


def _brute_continuation(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    n = len(tokens)
    for length in range(min(high, n - 1), low - 1, -1):
        suffix = tokens[n - length :]
        for end in range(n - 2, length - 2, -1):  # latest first; `end` is the match's last index
            if tokens[end - length + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


def test_prompt_lookup_continues_the_latest_longest_match() -> None:
    rng = np.random.default_rng(0)
    for _ in range(2000):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 40))).astype(np.int64)
        k = int(rng.integers(1, 6))
        got = continuation(tokens, k, 2, 4).tolist()
        assert got == _brute_continuation(tokens.tolist(), k, 2, 4), tokens.tolist()
    code = np.array([1, 2, 3, 4, 5, 6, 9, 9, 1, 2, 3])
    assert continuation(code, 3, 2, 4).tolist() == [4, 5, 6]


def test_a_sequence_guesses_more_while_right_and_pauses_while_wrong() -> None:
    lookup = Lookup.of([1, 2, 3], max_draft=8)
    assert lookup.draft_len == 4
    lookup.verified(step=1, drafted=4, kept=4, max_draft=8)
    assert lookup.draft_len == 6
    lookup.verified(step=2, drafted=6, kept=2, max_draft=8)
    assert lookup.draft_len == 3
    for step in range(3, 6):
        assert lookup.wanted(step, room=100) > 0
        lookup.verified(step, drafted=1, kept=0, max_draft=8)
    assert lookup.wanted(6, room=100) == 0  # paused
    assert lookup.wanted(6 + 8, room=100) == 1
    assert lookup.wanted(6 + 8, room=0) == 0  # no room left in the context


def test_the_guesses_a_row_keeps_are_read_from_its_own_passes() -> None:
    lookup = Lookup.of([1, 2, 3], max_draft=8)
    assert lookup.expected_kept(2) == [0.0, 0.5, 0.75]  # an even start
    # A row that copies: runs of four kept, or none.
    for step in range(10):
        lookup.verified(step, drafted=4, kept=4 if step % 2 else 0, max_draft=8)
    kept = lookup.expected_kept(6)
    assert kept[1] == pytest.approx(0.5, abs=0.05)  # the first guess: half the passes
    # Past the first, a guess is kept where the one before it was: the next three guesses keep
    # more than two (a geometric run at the first guess's chance: 0.44).
    assert kept[4] - kept[1] > 2 * kept[1]
    assert kept[6] > kept[4]  # positions never checked: the chance of the one before
    for _ in range(60):  # steps without a verify pass: back towards the even start
        lookup.fade()
    assert lookup.expected_kept(2) == pytest.approx([0.0, 0.5, 0.75], abs=0.01)


def test_the_guesses_a_step_verifies_are_as_many_as_they_pay_for() -> None:
    speculation = Speculation(max_draft=8, context=1000)
    history = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 5, 6]  # "5 6" was followed by 7 8 9 ...
    for stream_id in (1, 2):
        speculation.lookups[stream_id] = Lookup.of(history, max_draft=8)
    slots = np.array([1, 0, 2])  # a free slot between the two rows
    asked: list[Any] = []

    def worth(rows: list[list[float]], running: int, slot_count: int) -> int:
        asked.append((rows, running, slot_count))
        return 2

    drafts = speculation.drafts(slots, worth)
    even = [0.0, 0.5, 0.75, 0.875, 0.9375]  # each row's start: four guesses wanted
    assert asked == [([even, even], 2, 3)]
    assert drafts is not None and drafts.counts.tolist() == [2, 0, 2]
    assert drafts.tokens[0].tolist() == [7, 8]
    assert speculation.drafts(slots, lambda *_: 0) is None  # none pay: a plain decode step


ANSWER = "The quick brown fox jumps over the lazy dog, and the lazy dog sleeps in the sun all day."
# What the draft model writes instead: right for a while, then wrong, then right again.
DRAFT_ANSWER = "The quick brown fox jumps over the sleepy cat, and the lazy dog sleeps in a box."


def test_a_served_draft_model_guesses_and_the_reply_is_the_served_models(tmp_path: Path) -> None:
    """`mlxgate serve --draft-model`: a forced model whose script differs from the served
    model's in places guesses for it; every client gets the served model's reply, to the
    character, alone and four at once, streamed or not, and /metrics counts the guesses."""
    target = forced_model_dir(tmp_path, "qwen3", script=ANSWER, name="target")
    draft = forced_model_dir(tmp_path, "qwen3", script=DRAFT_ANSWER, name="draft")
    server = start_server(tmp_path, *serve_args(target), "--draft-model", str(draft))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-local", max_retries=0)
    try:

        def ask(n: int) -> str:
            messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": f"#{n}"}]
            if n % 2:
                chunks = client.chat.completions.create(
                    model="forced", max_tokens=60, messages=messages, stream=True
                )
                return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reply = client.chat.completions.create(model="forced", max_tokens=60, messages=messages)
            return reply.choices[0].message.content or ""

        assert ask(0) == ANSWER
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(ask, range(1, 5))) == [ANSWER] * 4
        samples = [
            sample
            for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
            for sample in family.samples
            if sample.name.startswith("mlxgate_engine_")
        ]
        metrics = {sample.name: sample.value for sample in samples}
        drafted = metrics["mlxgate_engine_drafted_tokens_total"]
        accepted = metrics["mlxgate_engine_accepted_tokens_total"]
        assert 0 < accepted < drafted
        guesses = ("verify_passes", "drafted_tokens", "accepted_tokens")
        names = {f"mlxgate_engine_{name}_total" for name in guesses}
        assert {s.labels.get("drafter") for s in samples if s.name in names} == {"draft-model"}
        log = server.log()
        assert "speculative decoding: a draft model (1 attention layers)" in log
        # Each request's line says what its verify passes kept.
        assert log.count("guesses kept, draft-model)") >= 5
    finally:
        stop_server(server)


def test_a_draft_model_with_another_tokenizer_stops_the_server_at_start_up(
    tmp_path: Path,
) -> None:
    target = forced_model_dir(tmp_path, "qwen3", script=ANSWER, name="target")
    draft = forced_model_dir(tmp_path, "gpt-oss", script=ANSWER, name="draft")
    serve = [sys.executable, "-m", "mlxgate", "serve", "--port", str(free_port())]
    run = subprocess.run(
        [*serve, *serve_args(target), "--draft-model", str(draft)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert run.returncode != 0
    assert "a draft model must share the served model's tokenizer" in run.stderr + run.stdout


def test_a_draft_model_that_cannot_decode_a_batch_is_refused() -> None:
    with pytest.raises(UnsupportedCache, match="draft model cannot decode several sequences"):
        Served(twins("llama")[0], draft_model=build("gemma2"))
