"""Every architecture family served exactly as `mlx_lm.generate` computes it.

Random-weight tiny models built from mlx-lm's own classes (support/tiny_models.py), served by the
real engine in-process; greedy tokens are compared with mlx-lm's `generate_step` on a second
instance with the same weights. Where batched shapes round differently a divergence is allowed
only at a step whose two top logits tie within float rounding, judged from mlx-lm's own
log-probabilities at that step; after it the two continuations are different texts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
from mlxgate._native import StreamSpec
from mlxgate.engine import GenerationRequest
from mlxgate.engine.cache_kinds import CacheLayout
from mlxgate.models.adapter import ModelAdapter
from support.tiny_engine import STEPS, Served, assert_same, prompts, reference, wait_until
from support.tiny_models import ARCHITECTURES, WINDOW, twins

CHUNK = 16  # the largest prefill pass: longer prompts take several

# mlx-lm cannot quantize these tiny shapes (a dimension below the group size) or at all.
NOT_QUANTIZABLE = {"nemotron_h", "granitemoehybrid", "lfm2"}
CASES = [
    *[pytest.param((arch, None), id=arch) for arch in ARCHITECTURES],
    *[
        pytest.param((arch, "affine"), id=f"{arch}-4bit")
        for arch in ARCHITECTURES
        if arch not in NOT_QUANTIZABLE
    ],
    pytest.param(("gpt_oss", "mxfp4"), id="gpt_oss-mxfp4"),
]


@pytest.fixture(params=CASES)
def case(request: pytest.FixtureRequest) -> Iterator[tuple[Served, Any, CacheLayout]]:
    arch, quantization = request.param
    served_model, reference_model = twins(arch, quantization)
    served = Served(served_model, max_prefill_chunk=CHUNK, min_prefill_chunk=8, prefix_cache_mb=64)
    yield served, reference_model, served.engine.layout
    served.engine.stop()


def test_greedy_output_equals_mlx_lm(case: tuple[Served, Any, CacheLayout]) -> None:
    served, model, _ = case
    engine = served.engine

    # (a) Alone, and (c) across the sliding window both in the prompt and while decoding.
    for prompt in ([5, 17, 3, 99], prompts(1, 2 * WINDOW, 3 * WINDOW, seed=1)[0]):
        tokens, _ = served.generate(prompt, steps=2 * WINDOW + 4)
        assert_same(tokens, reference(model, prompt, 2 * WINDOW + 4), "alone")

    # (b) Sixteen different prompts at once: prefilled in groups, decoded in one batch.
    many = prompts(16, 3, 3 * WINDOW, seed=2)
    readers = [served.submit(p) for p in many]
    for i, (reader, prompt) in enumerate(zip(readers, many, strict=True)):
        assert_same(served.result(reader)[0], reference(model, prompt), f"batched row {i}")

    # (d) A prompt longer than a prefill pass: several chunks, then joining a running batch.
    long_prompt = prompts(1, 5 * CHUNK, 5 * CHUNK + 1, seed=3)[0]
    passes = engine.metrics.prefill_passes
    beside = served.submit(many[0], steps=40)
    tokens, _ = served.generate(long_prompt)
    assert engine.metrics.prefill_passes - passes >= 5
    assert_same(tokens, reference(model, long_prompt), "chunked prompt")
    assert_same(served.result(beside)[0], reference(model, many[0], 40), "beside the chunks")

    # (g) Three choices of one prompt (OpenAI's n): prefilled once, each on its own copy.
    spec = StreamSpec.openai(model="tiny", completion_id="cmpl-n", created=1, stream=False)
    reader = engine.admit(GenerationRequest(many[1], spec, STEPS, choices=3))
    for i, message in enumerate(served.choices(reader)):
        tokens = [int(t) for t in message["content"].split(",") if t]
        assert_same(tokens, reference(model, many[1]), f"choice {i}")


def test_cached_prefixes_are_reused_exactly_and_reported(
    case: tuple[Served, Any, CacheLayout],
) -> None:
    served, model, layout = case
    first = prompts(1, 40, 41, seed=4)[0]
    reply, _ = served.generate(first)
    # (The reply is kept in the step that ends it, just after its client is woken.)
    wait_until(lambda: served.engine.metrics.running == 0, served.engine)
    # An agent's next turn: the whole previous prompt and reply, then more. The reply was kept
    # as it ended: its last token was sampled, never fed, unless a verify pass fed guesses past
    # the end (then the cache holds those, and the next turn may reuse one more).
    turn = first + reply + prompts(1, 20, 21, seed=5)[0]
    tokens, usage = served.generate(turn)
    assert usage["cache_read_input_tokens"] in (len(first) + len(reply) - 1, len(turn) - 20)
    assert served.engine.metrics.reply_tokens_kept >= len(reply)
    assert_same(tokens, reference(model, turn), "next turn")
    # Another conversation sharing only the first 24 tokens: attention keys/values are cut
    # there; a window or a recurrent state cannot be, so nothing is reused (and none reported).
    branch = first[:24] + prompts(1, 20, 21, seed=6)[0]
    tokens, usage = served.generate(branch)
    assert usage["cache_read_input_tokens"] == (24 if layout.cuttable else 0)
    assert_same(tokens, reference(model, branch), "branch")


def test_cancelled_requests_leave_the_others_exact(case: tuple[Served, Any, CacheLayout]) -> None:
    served, model, _ = case
    engine = served.engine
    others = prompts(4, 3, 3 * WINDOW, seed=7)
    readers = [served.submit(p, steps=200) for p in others]
    # (A model mlx-lm cannot batch decodes one sequence at a time.)
    room = engine.settings.max_running
    wait_until(lambda: engine.metrics.running == min(len(others), room), engine)
    # Mid-decode: a stream that joined the batch, cancelled after a few steps.
    decoding = served.submit(prompts(1, 10, 11, seed=8)[0], steps=1000)
    if room > len(others):
        wait_until(lambda: engine.metrics.running == len(others) + 1, engine)
    decoding.cancel()
    # Mid-prefill: a long prompt cut off between its chunks.
    long_prompt = prompts(1, 40 * CHUNK, 40 * CHUNK + 1, seed=9)[0]
    prefilled = engine.metrics.prefill_tokens
    prefilling = served.submit(long_prompt)
    wait_until(lambda: engine.metrics.prefill_tokens > prefilled, engine)
    prefilling.cancel()
    for i, (reader, prompt) in enumerate(zip(readers, others, strict=True)):
        assert_same(served.result(reader)[0], reference(model, prompt, 200), f"row {i}")
    assert engine.metrics.prefill_tokens - prefilled < len(long_prompt)
    wait_until(lambda: engine.metrics.running == 0 and engine.metrics.queue_depth == 0, engine)
    assert engine.metrics.requests_cancelled == 2


@pytest.mark.parametrize(
    ("arch", "described"),
    [
        ("llama", "4 attention layers"),
        ("qwen3_next", "4 layers: 2 recurrent, 2 attention"),
        ("gpt_oss", "4 layers: 2 sliding-window attention, 2 attention"),
    ],
)
def test_the_layout_names_each_layer_kind(arch: str, described: str) -> None:
    model, _ = twins(arch)
    adapter = ModelAdapter(model)
    layout = CacheLayout.of(adapter.make_cache(), adapter.watched)
    assert layout.describe() == described
    assert layout.cuttable == (arch == "llama")
    # Guesses are taken back from attention, a window, a gated delta layer's recorded pass.
    assert layout.rewindable


@pytest.mark.parametrize(
    ("arch", "prefill", "decode"),
    [
        ("llama", None, None),
        ("gemma2", "broadcast_shapes", "broadcast_shapes"),  # its mask over the wrong axis
        ("nemotron_h", "differ", None),  # padding in its recurrent state
    ],
)
def test_batches_that_mlx_lm_gets_wrong_are_found_at_start_up(
    arch: str, prefill: str | None, decode: str | None
) -> None:
    from mlxgate.engine import batch_check

    model, _ = twins(arch)
    adapter = ModelAdapter(model)
    problems = batch_check.check(adapter, CacheLayout.of(adapter.make_cache()), banded=False)
    for found, expected in ((problems.prefill, prefill), (problems.decode, decode)):
        assert (found is None) == (expected is None), found
        assert expected is None or expected in (found or "")


def test_a_model_with_a_cache_the_engine_cannot_batch_fails_at_start_up() -> None:
    from mlx_lm.models.cache import ChunkedKVCache

    from mlxgate.engine.cache_kinds import UnsupportedCache

    model, _ = twins("llama")
    model.make_cache = lambda: [ChunkedKVCache(8) for _ in model.layers]
    with pytest.raises(UnsupportedCache, match="ChunkedKVCache"):
        Served(model)
