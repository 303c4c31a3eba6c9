"""Every architecture family served exactly as `mlx_lm.generate` computes it.

Random-weight tiny models built from mlx-lm's own classes (tests/tiny_models.py), served by the
real engine in-process; greedy tokens are compared with mlx-lm's `generate_step` on a second
instance with the same weights. Where batched shapes round differently a divergence is allowed
only at a step whose two top logits tie within float rounding, judged from mlx-lm's own
log-probabilities at that step; after it the two continuations are different texts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import orjson
import pytest
from tiny_models import ARCHITECTURES, VOCAB, WINDOW, twins

import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
from mlxgate._native import Reader, Reply, Router, StreamSpec, Vocab
from mlxgate.engine import Engine, EngineSettings, GenerationRequest
from mlxgate.engine.cache_kinds import CacheLayout
from mlxgate.models import LoadedModel
from mlxgate.models.adapter import ModelAdapter, install_kernels
from mlxgate.models.context import ServedContext

# Log-probability gap within which two tokens tie: float32 rounding of different matmul shapes
# moves logits by ~1e-6; a wrong computation moves them by whole units.
TIE = 1e-4
STEPS = 12
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


@dataclass
class Expected:
    tokens: list[int]
    logprobs: list[np.ndarray]


def reference(model: Any, prompt: list[int], steps: int = STEPS) -> Expected:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out = Expected([], [])
    for token, logprobs in generate_step(mx.array(prompt), model, max_tokens=steps):
        out.tokens.append(int(token))
        out.logprobs.append(np.array(logprobs.astype(mx.float32)))
    return out


def assert_same(got: list[int], want: Expected, what: str) -> None:
    """Equal token for token, or equal up to a step where mlx-lm's top two tokens tie."""
    for step, (ours, theirs) in enumerate(zip(got, want.tokens, strict=False)):
        if ours != theirs:
            logprobs = want.logprobs[step]
            gap = float(logprobs[theirs] - logprobs[ours])
            assert gap <= TIE, (
                f"{what}: step {step} gave {ours} where mlx-lm gives {theirs} "
                f"(log-probability {gap:.3g} lower: not a tie)\n ours {got}\ntheirs {want.tokens}"
            )
            return
    assert len(got) == len(want.tokens), f"{what}: {len(got)} tokens, mlx-lm {len(want.tokens)}"


class Served:
    """The engine over one tiny model, with a vocabulary whose token i reads `i,`."""

    def __init__(
        self,
        model: Any,
        context_length: int = 4096,
        draft_model: Any = None,
        context: ServedContext | None = None,
        **settings: Any,
    ) -> None:
        for m in (model, draft_model):
            if m is not None:
                install_kernels(m)  # as `models.load` does
        vocab = Vocab.from_token_bytes([f"{i},".encode() for i in range(VOCAB)], [])
        loaded = LoadedModel("tiny", model, cast(Any, None), context_length, "test", context)
        self.engine = Engine(
            loaded, Router(vocab), EngineSettings(**settings), draft_model=draft_model
        )
        self.engine.start()

    def submit(self, prompt: list[int], steps: int = STEPS) -> Reader:
        spec = StreamSpec.anthropic(
            model="tiny",
            message_id="msg_t",
            stream=False,
            stop_sequences=[],
            reply=Reply(eos_ids=[]),
        )
        return self.engine.admit(GenerationRequest(prompt, spec, steps))

    @staticmethod
    def result(reader: Reader, timeout_s: float = 120.0) -> tuple[list[int], dict[str, Any]]:
        """The generated token ids and the usage of a finished stream."""
        message = Served.body(reader, timeout_s)
        assert message["type"] == "message", message
        text = "".join(block["text"] for block in message["content"])
        return [int(t) for t in text.split(",") if t], message["usage"]

    @staticmethod
    def choices(reader: Reader, timeout_s: float = 120.0) -> list[dict[str, Any]]:
        """The messages of a finished OpenAI response with several choices, in order."""
        response = Served.body(reader, timeout_s)
        return [choice["message"] for choice in response["choices"]]

    @staticmethod
    def body(reader: Reader, timeout_s: float) -> dict[str, Any]:
        ready = threading.Event()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            data = reader.take()
            assert data is not None, "stream ended without a body"
            if data:
                return orjson.loads(data)  # type: ignore[no-any-return]
            ready.clear()
            if reader.park(ready, lambda _: ready.set()):
                ready.wait(max(0.0, deadline - time.monotonic()))
        raise TimeoutError("no body")

    def generate(self, prompt: list[int], steps: int = STEPS) -> tuple[list[int], dict[str, Any]]:
        return self.result(self.submit(prompt, steps))


def prompts(count: int, low: int, high: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [
        rng.integers(1, VOCAB, size=int(rng.integers(low, high))).tolist() for _ in range(count)
    ]


def wait_until(condition: Any, engine: Engine, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"condition not met in time: {engine.metrics}"
        time.sleep(0.002)


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
    served.generate(first)
    # An agent's next turn: the whole previous prompt, then more.
    turn = first + prompts(1, 20, 21, seed=5)[0]
    tokens, usage = served.generate(turn)
    assert usage["cache_read_input_tokens"] == len(first) - 1
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
    layout = CacheLayout.of(ModelAdapter(model).make_cache())
    assert layout.describe() == described
    assert layout.cuttable == (arch == "llama")


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
