"""KV memory and prefill as managed resources, on a random-weight tiny llama in-process: short
prompts go before long ones, a prefix being prefilled is computed once, and the KV memory budget
preempts and resumes sequences exactly instead of running out of memory."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
from support.tiny_engine import Served, assert_same, prompts, reference, wait_until
from support.tiny_models import twins

import mlx.core as mx  # isort: skip
from mlxgate.engine import PromptTooLong
from mlxgate.engine.kv_memory import COLUMNS_STEP

TOKEN_BYTES = 4 * 2 * 2 * 16 * 4  # the tiny llama: layers x (keys, values) x heads x dim x f32


@pytest.fixture(scope="module")
def llama() -> tuple[Any, Any]:
    return twins("llama")


def serve(model: Any, **settings: Any) -> Served:
    settings.setdefault("max_prefill_chunk", 64)
    settings.setdefault("max_prefill_tokens", 128)
    return Served(model, context_length=8192, **settings)


@pytest.fixture
def served(llama: tuple[Any, Any]) -> Iterator[Served]:
    running = serve(llama[0])
    yield running
    running.engine.stop()


def finished_at(reader: Any, times: dict[str, float], name: str) -> threading.Thread:
    """A thread that waits for the reader's body and notes when it came, and the output."""

    def wait() -> None:
        times[name + "_result"] = Served.result(reader)  # type: ignore[assignment]
        times[name] = time.monotonic()

    thread = threading.Thread(target=wait)
    thread.start()
    return thread


def test_a_short_prompt_goes_before_a_long_one_in_prefill(
    served: Served, llama: tuple[Any, Any]
) -> None:
    engine, model = served.engine, llama[1]
    long_prompt, short_prompt = prompts(1, 3000, 3001, seed=1)[0], prompts(1, 100, 101, seed=2)[0]
    long_reader = served.submit(long_prompt, steps=4)
    wait_until(lambda: engine.metrics.prefill_tokens > 0, engine)
    short_reader = served.submit(short_prompt, steps=4)
    short_tokens, _ = Served.result(short_reader)
    # The short one's reply is whole while the long prompt has not yet made its first token.
    assert long_reader.output_tokens == 0
    assert engine.metrics.prefill_tokens < len(long_prompt)
    long_tokens, _ = Served.result(long_reader)
    assert_same(short_tokens, reference(model, short_prompt, 4), "short")
    assert_same(long_tokens, reference(model, long_prompt, 4), "long")


def test_a_prefix_being_prefilled_is_computed_once(served: Served, llama: tuple[Any, Any]) -> None:
    engine, model = served.engine, llama[1]
    prompt = prompts(1, 1500, 1501, seed=3)[0]
    before = engine.metrics.prefill_tokens
    readers = [served.submit(prompt, steps=6) for _ in range(2)]
    results = [Served.result(reader) for reader in readers]
    want = reference(model, prompt, 6)
    for tokens, _ in results:
        assert_same(tokens, want, "identical prompts")
    assert engine.metrics.prefill_tokens - before == len(prompt) - 1
    assert engine.metrics.inflight_hit_tokens == len(prompt) - 1
    # The second was opened with nothing cached; its usage reports what it reused, and from where.
    assert [usage["cache_read_input_tokens"] for _, usage in results] == [0, len(prompt) - 1]
    assert [reader.cached_from for reader in readers] == ["", "in-flight"]
    # A prompt that shares only a prefix starts from it as soon as the other has computed it.
    wait_until(lambda: engine.metrics.running == 0, engine)
    engine.prefix_cache.max_bytes = 0  # only in-flight sharing can help here
    other = prompts(1, 1500, 1501, seed=4)[0]
    branch = other[:1000] + prompts(1, 300, 301, seed=5)[0]
    before = engine.metrics.prefill_tokens
    readers = [served.submit(other, steps=6), served.submit(branch, steps=6)]
    assert_same(Served.result(readers[0])[0], reference(model, other, 6), "other")
    assert_same(Served.result(readers[1])[0], reference(model, branch, 6), "branch")
    assert engine.metrics.prefill_tokens - before == len(other) - 1 + len(branch) - 1 - 1000


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3_text"])
def test_a_window_or_recurrent_state_being_prefilled_is_computed_once(arch: str) -> None:
    """Such a state cannot be cut: the second prompt waits for the first's whole prefill and
    starts from its snapshot as it joins the batch."""
    model, twin = twins(arch)
    served = serve(model)
    try:
        engine = served.engine
        prompt = prompts(1, 700, 701, seed=13)[0]
        readers = [served.submit(prompt, steps=6) for _ in range(2)]
        want = reference(twin, prompt, 6)
        for reader in readers:
            assert_same(Served.result(reader)[0], want, arch)
        assert engine.metrics.prefill_tokens == len(prompt) - 1
        assert engine.metrics.inflight_hit_tokens == len(prompt) - 1
    finally:
        served.engine.stop()


@pytest.mark.parametrize("cancelled", [0, 1])
def test_a_cancel_on_either_side_of_a_shared_prefill_keeps_the_other_exact(
    served: Served, llama: tuple[Any, Any], cancelled: int
) -> None:
    engine, model = served.engine, llama[1]
    prompt = prompts(1, 2000, 2001, seed=6 + cancelled)[0]
    before = engine.metrics.prefill_tokens
    readers = [served.submit(prompt, steps=6) for _ in range(2)]
    wait_until(lambda: engine.metrics.prefill_tokens - before > len(prompt) // 2, engine)
    readers[cancelled].cancel()
    tokens, _ = Served.result(readers[1 - cancelled])
    assert_same(tokens, reference(model, prompt, 6), "the other")
    # What the cancelled one computed is not computed again.
    assert engine.metrics.prefill_tokens - before < len(prompt) + 2 * 64


def test_under_a_small_kv_budget_every_request_completes_exactly(llama: tuple[Any, Any]) -> None:
    model, twin = llama
    # Room for about three of these sequences' caches at once, eight sent together: prompts start
    # as room frees, and rows that grow past the budget are preempted and resumed.
    budget = 3 * 512 * TOKEN_BYTES
    served = serve(model, kv_memory_gb=budget / 2**30, prefix_cache_mb=64)
    engine = served.engine
    try:
        assert engine.kv_memory.token_bytes == TOKEN_BYTES
        batch = prompts(8, 200, 300, seed=10)
        wants = [reference(twin, prompt, 400) for prompt in batch]
        gc.collect()
        mx.reset_peak_memory()
        baseline = mx.get_active_memory()
        readers = [served.submit(prompt, steps=400) for prompt in batch]
        for i, (reader, want) in enumerate(zip(readers, wants, strict=True)):
            assert_same(Served.result(reader)[0], want, f"request {i}")
        peak = mx.get_peak_memory() - baseline
        assert engine.metrics.preemptions >= 1
        # The caches stay within the budget. Beyond it: the copies made while rows join, leave
        # and grow (a band's caches are copied whole: at most the budget again), the prefix
        # cache's entries (kept replies, preempted rows' keys/values) and a step's activations.
        slack = budget + engine.prefix_cache.nbytes + 2 * 2**20
        assert peak <= budget + slack, (peak, budget)
    finally:
        engine.stop()


def test_a_prompt_that_cannot_fit_the_kv_budget_alone_is_refused(llama: tuple[Any, Any]) -> None:
    budget = 4 * COLUMNS_STEP * TOKEN_BYTES
    served = serve(llama[0], kv_memory_gb=budget / 2**30)
    try:
        with pytest.raises(PromptTooLong) as refused:
            served.submit(prompts(1, 1100, 1101, seed=11)[0])
        assert refused.value.memory
        assert refused.value.context_length == 4 * COLUMNS_STEP - 1
        assert "--kv-memory-gb" in str(refused.value)
        # One that fits is served.
        tokens, _ = served.generate(prompts(1, 500, 501, seed=12)[0])
        assert len(tokens) == 12
    finally:
        served.engine.stop()


def test_the_memory_refusal_reads_as_the_clients_prompt_too_long() -> None:
    """Claude Code reads the two numbers of "prompt is too long" to decide to compact."""
    from mlxgate.api.pipeline import prompt_too_long

    error = prompt_too_long(PromptTooLong(5000, 1023, memory=True))
    assert str(error).startswith("prompt is too long: 5000 tokens > 1023 maximum")
    assert "--kv-memory-gb" in str(error)
