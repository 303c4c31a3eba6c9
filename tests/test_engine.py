"""The engine with the real model, in-process: batching, cancellation, limits, prefix reuse."""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
from support.tiny_engine import Served

import mlx.core as mx  # isort: skip
from mlxgate._native import Dialect, Reader, Reply, Router, StreamSpec
from mlxgate.api.anthropic.routes import ADMISSION_ERRORS as ANTHROPIC_ADMISSION_ERRORS
from mlxgate.engine import (
    Engine,
    EngineSettings,
    GenerationRequest,
    PromptTooLong,
    QueueFull,
    cache_kinds,
)
from mlxgate.models import LoadedModel, load

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "What is 2 + 2?",
    "Write a haiku about snow.",
    "Who wrote Hamlet?",
    "What is the largest planet?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "What language is spoken in Brazil?",
    "What is the boiling point of water?",
    "Name a famous painter.",
    "What is the opposite of cold?",
    "Translate 'hello' into Spanish.",
    "What do bees make?",
    "What is the chemical symbol for gold?",
    "How many days are in a week?",
]


@pytest.fixture(scope="module")
def smollm() -> LoadedModel:
    # Its own 8,192-token context and rope: the checks that answers make sense (Paris) hold for
    # the model as trained; YaRN (the 32k default) changes short answers (docs/models.md).
    return load(None, context_length=8192)


def make_engine(smollm: LoadedModel, **settings: Any) -> Engine:
    tok = smollm.tokenizer
    vocab = tok.native_vocab()
    engine = Engine(smollm, Router(vocab), EngineSettings(**settings))
    engine.start()
    return engine


@pytest.fixture(scope="module")
def engine(smollm: LoadedModel) -> Iterator[Engine]:
    running = make_engine(smollm)
    yield running
    running.stop()


def prompt_ids(engine: Engine, question: str) -> list[int]:
    tok = engine.loaded.tokenizer
    return tok.encode(tok.render([{"role": "user", "content": question}]))


def submit(
    engine: Engine,
    ids: list[int],
    max_tokens: int,
    stop: list[str] | None = None,
    stream: bool = False,
) -> Reader:
    spec = StreamSpec.anthropic(
        model="m",
        message_id="msg_test",
        stream=stream,
        stop_sequences=stop or [],
        reply=Reply(eos_ids=sorted(engine.loaded.tokenizer.eos_ids)),
    )
    return engine.admit(GenerationRequest(ids, spec, max_tokens))


body = Served.body  # the non-streamed Message body


def text(message: dict[str, Any]) -> str:
    return "".join(block["text"] for block in message["content"])


def wait_until(condition: Any, timeout_s: float) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "condition not met in time"
        time.sleep(0.01)
    return time.monotonic() - started


def idle(engine: Engine) -> bool:
    m = engine.metrics
    return m.running == 0 and m.queue_depth == 0 and len(engine.router) == 0


def test_concurrent_requests_get_their_own_greedy_outputs(engine: Engine) -> None:
    prompts = [prompt_ids(engine, q) for q in QUESTIONS]
    engine.prefix_cache.max_bytes, saved = 0, engine.prefix_cache.max_bytes  # all computed
    try:
        alone = [text(body(submit(engine, ids, 16))) for ids in prompts]
        passes = engine.metrics.prefill_passes
        readers = [submit(engine, ids, 16) for ids in prompts]
        together = [text(body(reader)) for reader in readers]
    finally:
        engine.prefix_cache.max_bytes = saved
    assert together == alone
    # Short prompts arriving together are prefilled several to a forward pass.
    assert engine.metrics.prefill_passes - passes < len(prompts) // 2
    assert len(set(alone)) > 8  # distinct prompts really gave distinct answers
    assert "Paris" in alone[0]


def test_prompts_prefilled_together_are_cached_exactly(engine: Engine) -> None:
    # Different lengths, some sharing a cached prefix: rows padded differently in one pass.
    prompts = [
        prompt_ids(engine, q + " Answer in a few words." * (i % 3))
        for i, q in enumerate(QUESTIONS[:8])
    ]
    body(submit(engine, prompts[0], 1))  # caches the first prompt
    passes = engine.metrics.prefill_passes
    readers = [submit(engine, ids, 12) for ids in prompts]
    together = [text(body(reader)) for reader in readers]
    assert engine.metrics.prefill_passes - passes < len(prompts)
    again = [body(submit(engine, ids, 12)) for ids in prompts]
    assert [m["usage"]["cache_read_input_tokens"] for m in again] == [len(p) - 1 for p in prompts]
    assert [text(m) for m in again] == together


def test_a_joining_row_takes_a_finished_rows_slot_exactly(engine: Engine) -> None:
    prompts = [prompt_ids(engine, q) for q in QUESTIONS[:5]]
    engine.prefix_cache.max_bytes, saved = 0, engine.prefix_cache.max_bytes  # all computed
    try:
        alone = [text(body(submit(engine, ids, 12))) for ids in prompts]
        keeper = submit(engine, prompt_ids(engine, "Write a very long story about a dragon."), 400)
        wait_until(lambda: engine.metrics.running == 1, 30.0)
        beside = []
        for ids in prompts:  # one after another: each is written into the slot the last one left
            beside.append(text(body(submit(engine, ids, 12))))
            assert len(engine.decoder.batch.stream_ids) == 2, "a slot was added instead of reused"
        keeper.cancel()
        wait_until(lambda: idle(engine), 10.0)
    finally:
        engine.prefix_cache.max_bytes = saved
    assert beside == alone


def test_a_long_prompt_decodes_in_a_band_of_its_own_exactly(engine: Engine) -> None:
    story = prompt_ids(engine, "Write a very long story about a dragon.")
    long_prompt = prompt_ids(engine, "word " * 700 + "Summarize that.")
    engine.prefix_cache.max_bytes, saved = 0, engine.prefix_cache.max_bytes  # all computed
    bands_seen: set[int] = set()
    done = threading.Event()

    def watch_bands() -> None:
        while not done.is_set():
            bands_seen.add(len(engine.decoder.batch.bands))
            time.sleep(0.005)

    try:
        story_alone = text(body(submit(engine, story, 120)))
        long_alone = text(body(submit(engine, long_prompt, 8)))
        watcher = threading.Thread(target=watch_bands)
        watcher.start()
        keeper = submit(engine, story, 120)
        wait_until(lambda: engine.metrics.running == 1, 30.0)
        long_beside = text(body(submit(engine, long_prompt, 8)))
        story_beside = text(body(keeper))
        done.set()
        watcher.join()
    finally:
        engine.prefix_cache.max_bytes = saved
    # ~700 tokens joining a row of ~100: a band of its own, not 600 columns of padding for both.
    assert 2 in bands_seen
    assert long_beside == long_alone
    assert story_beside == story_alone


def test_prompt_lookup_guesses_from_the_prompt_and_changes_no_token(
    smollm: LoadedModel, engine: Engine
) -> None:
    """Two sequences that copy from their prompts, in bands of their own (700 and 90 tokens
    apart), decoding together with guesses: the tokens of an engine that never guesses."""
    listing = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}" for i in range(40))
    long_copy = prompt_ids(engine, f"```python\n{listing}\n```\nRewrite this file, f7 renamed g7.")
    short_copy = prompt_ids(engine, "Repeat exactly: alpha beta gamma delta alpha beta gamma.")
    plain = make_engine(smollm, max_draft_tokens=0)
    try:
        want = [text(body(submit(plain, ids, 96))) for ids in (long_copy, short_copy)]
    finally:
        plain.stop()
    before = engine.metrics.snapshot()
    readers = [submit(engine, ids, 96) for ids in (long_copy, short_copy)]
    got = [text(body(reader)) for reader in readers]
    after = engine.metrics.snapshot()
    assert got == want
    assert after["accepted_tokens"] - before["accepted_tokens"] > 20
    assert after["verify_passes"] > before["verify_passes"]


def test_stop_sequence_ends_generation_without_leaking(engine: Engine) -> None:
    ids = prompt_ids(engine, QUESTIONS[0])
    plain = text(body(submit(engine, ids, 32)))
    assert "Paris" in plain
    stopped = body(submit(engine, ids, 32, stop=["Paris"]))
    assert stopped["stop_reason"] == "stop_sequence"
    assert stopped["stop_sequence"] == "Paris"
    assert text(stopped) == plain[: plain.index("Paris")]
    wait_until(lambda: idle(engine), 2.0)


def test_max_tokens_and_end_turn(engine: Engine) -> None:
    ids = prompt_ids(engine, QUESTIONS[0])
    short = body(submit(engine, ids, 3))
    assert short["stop_reason"] == "max_tokens" and short["usage"]["output_tokens"] == 3
    full = body(submit(engine, ids, 200))
    assert full["stop_reason"] == "end_turn" and full["usage"]["output_tokens"] < 200


def test_cancel_while_decoding_frees_the_slot_within_a_step(engine: Engine) -> None:
    reader = submit(engine, prompt_ids(engine, "Write a very long story about a dragon."), 2000)
    wait_until(lambda: engine.metrics.running == 1, 30.0)
    decoded = engine.metrics.decode_tokens
    reader.cancel()
    wait_until(lambda: idle(engine), 10.0)
    # Wall time is no measure on a shared machine; steps are: at most the step under way.
    assert engine.metrics.decode_tokens - decoded <= 2


def test_cancel_during_prefill_stops_the_prefill(engine: Engine) -> None:
    long_prompt = prompt_ids(engine, "word " * 3000)
    prefilled = engine.metrics.prefill_tokens
    reader = submit(engine, long_prompt, 10)
    wait_until(lambda: engine.metrics.prefill_tokens > prefilled, 30.0)
    reader.cancel()
    wait_until(lambda: idle(engine), 10.0)
    # The prefill stopped inside the chunk under way when the cancel came.
    assert engine.metrics.prefill_tokens - prefilled <= 2 * engine.settings.max_prefill_chunk
    assert engine.metrics.prefill_tokens - prefilled < len(long_prompt) // 2


def choices_spec(engine: Engine) -> StreamSpec:
    return StreamSpec.openai(
        model="m",
        completion_id="chatcmpl-n",
        created=1,
        stream=False,
        reply=Reply(eos_ids=sorted(engine.loaded.tokenizer.eos_ids)),
    )


def test_choices_of_one_prompt_prefill_once_into_one_response(engine: Engine) -> None:
    """OpenAI's n: one prefill, then each choice decodes on its own copy of the cache, and the
    one response holds every choice."""
    ids = prompt_ids(engine, "Some context for three choices. " * 100 + QUESTIONS[0])
    prefilled, hit = engine.metrics.prefill_tokens, engine.metrics.cache_hit_tokens
    reader = engine.admit(GenerationRequest(ids, choices_spec(engine), 12, choices=3))
    response = body(reader)
    answers = [choice["message"]["content"] for choice in response["choices"]]
    assert [choice["index"] for choice in response["choices"]] == [0, 1, 2]
    cached = engine.metrics.cache_hit_tokens - hit  # the chat template's opening, maybe
    assert engine.metrics.prefill_tokens - prefilled == len(ids) - 1 - cached
    assert response["usage"]["prompt_tokens"] == len(ids)
    wait_until(lambda: idle(engine), 10.0)
    assert answers == [text(body(submit(engine, ids, 12)))] * 3


def test_cancelling_a_response_of_several_choices_ends_them_all_mid_prefill(
    engine: Engine,
) -> None:
    """The client of a response with two choices leaves in the middle of their prefill: both
    end, the prefill stops in the pass under way, and the engine goes on."""
    ids = prompt_ids(engine, "word " * 3000 + QUESTIONS[1])
    chunk = engine.settings.max_prefill_chunk
    prefilled = engine.metrics.prefill_tokens
    reader = engine.admit(GenerationRequest(ids, choices_spec(engine), 8, choices=2))
    wait_until(lambda: engine.metrics.prefill_tokens - prefilled >= 2 * chunk, 60.0)
    reader.cancel()
    wait_until(lambda: idle(engine), 10.0)
    assert engine.metrics.prefill_tokens - prefilled < len(ids) - chunk
    assert reader.end == "cancelled"
    assert "Paris" in text(body(submit(engine, prompt_ids(engine, QUESTIONS[0]), 16)))


def test_cancel_while_queued(engine: Engine) -> None:
    blockers = [submit(engine, prompt_ids(engine, "word " * 1500), 5) for _ in range(2)]
    queued = submit(engine, prompt_ids(engine, QUESTIONS[1]), 5)
    queued.cancel()
    for reader in blockers:
        reader.cancel()
    wait_until(lambda: idle(engine), 5.0)
    assert queued.take() is None


def test_a_fault_while_joining_the_batch_fails_that_stream_and_the_engine_goes_on(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream the prefill took off the queue but had not yet put in the batch is failed, not
    left waiting forever."""

    def injected_fault(cache: Any) -> Any:
        raise RuntimeError("injected fault")

    with monkeypatch.context() as patched:
        patched.setattr(cache_kinds, "batch_of_one", injected_fault)
        failed = body(submit(engine, prompt_ids(engine, QUESTIONS[0]), 8), timeout_s=30)
    assert failed["error"]["message"] == "generation failed: injected fault"
    wait_until(lambda: idle(engine), 10.0)
    assert "Paris" in text(body(submit(engine, prompt_ids(engine, QUESTIONS[0]), 16)))


def test_prompt_too_long(engine: Engine) -> None:
    with pytest.raises(PromptTooLong) as caught:
        submit(engine, [1] * 9000, 10)
    assert (caught.value.prompt_tokens, caught.value.context_length) == (9000, 8192)


def test_max_tokens_is_clamped_to_the_context(engine: Engine) -> None:
    opened: list[dict[str, Any]] = []
    router = engine.router

    class Recording:
        """The engine's router, recording what each stream is opened with."""

        def open(self, *args: Any, **kwargs: Any) -> Reader:
            opened.append(kwargs)
            return router.open(*args, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(router, name)

    engine.router = Recording()  # type: ignore[assignment]
    try:
        reader = submit(engine, [1] * 8190, 128000)
    finally:
        engine.router = router
    reader.cancel()
    wait_until(lambda: idle(engine), 30.0)
    assert opened[0]["max_tokens"] == 2
    assert opened[0]["prompt_tokens"] == 8190


def test_queue_full_is_refused_and_the_engine_recovers(smollm: LoadedModel, engine: Engine) -> None:
    ids = prompt_ids(engine, "word " * 600)
    readers = []
    with pytest.raises(QueueFull) as caught:
        for _ in range(engine.settings.max_queued + 8):
            readers.append(submit(engine, ids, 5))
    assert caught.value.retry_after_s >= 1
    # The engine's error has no status; Anthropic's table words it as a 529 with retry-after.
    answer = ANTHROPIC_ADMISSION_ERRORS[QueueFull](caught.value)
    assert (
        answer.status(Dialect.ANTHROPIC) == 529
        and answer.retry_after_s == caught.value.retry_after_s
    )
    for reader in readers:
        reader.cancel()
    wait_until(lambda: idle(engine), 10.0)
    assert "Paris" in text(body(submit(engine, prompt_ids(engine, QUESTIONS[0]), 16)))


def test_prefix_cache_reuse_is_exact(engine: Engine) -> None:
    shared = "You are a careful assistant. " * 20
    first_ids = prompt_ids(engine, shared + "What is the capital of France?")
    other_ids = prompt_ids(engine, shared + "Name three colors.")
    first = body(submit(engine, first_ids, 16))
    assert first["usage"]["cache_read_input_tokens"] == 0 or first["usage"]["input_tokens"] > 0
    hits = engine.metrics.cache_hit_tokens
    again = body(submit(engine, first_ids, 16))
    assert again["usage"]["cache_read_input_tokens"] > 100
    assert text(again) == text(first)
    # A different question over the same prefix reuses the prefix and answers its own question.
    other = body(submit(engine, other_ids, 16))
    assert other["usage"]["cache_read_input_tokens"] > 100
    assert engine.metrics.cache_hit_tokens > hits
    engine.prefix_cache.max_bytes, saved = 0, engine.prefix_cache.max_bytes
    try:
        uncached = body(submit(engine, other_ids, 16))
    finally:
        engine.prefix_cache.max_bytes = saved
    assert uncached["usage"]["cache_read_input_tokens"] == 0
    assert text(other) == text(uncached)


def test_the_prefix_cache_holds_the_bytes_it_counts(smollm: LoadedModel) -> None:
    """Entries of short prompts, stored one at a time and from a batched prefill, hold just their
    tokens (a view of a prefill's buffer kept 256 columns per layer alive: 3.7x the count)."""
    engine = make_engine(smollm)
    try:
        body(submit(engine, prompt_ids(engine, "Warm up."), 2))
        wait_until(lambda: idle(engine), 10.0)
        gc.collect()
        before, counted = mx.get_active_memory(), engine.prefix_cache.nbytes
        for question in QUESTIONS[:8]:
            body(submit(engine, prompt_ids(engine, question), 2))
        readers = [submit(engine, prompt_ids(engine, q + " Be brief."), 2) for q in QUESTIONS]
        for reader in readers:
            body(reader)
        wait_until(lambda: idle(engine), 10.0)
        gc.collect()
        held = mx.get_active_memory() - before
        stored = engine.prefix_cache.nbytes - counted
        assert stored > 20 * 2**20  # ~24 entries of ~30 tokens, ~46 KB per token
        assert held < stored * 1.05 + 4 * 2**20, (held, stored)
        if sys.platform == "linux":
            assert engine.metrics.heap_trims >= 1  # on going idle (engine/heap.py)
    finally:
        engine.stop()


def test_concurrent_prefix_sharing_does_not_cross_contaminate(engine: Engine) -> None:
    shared = "Answer briefly and precisely. " * 15
    prompts = [prompt_ids(engine, shared + q) for q in QUESTIONS[:6]]
    body(submit(engine, prompts[0], 4))  # seeds the cache with the shared prefix
    engine.prefix_cache.max_bytes, saved = 0, engine.prefix_cache.max_bytes
    try:
        reference = [text(body(submit(engine, ids, 12))) for ids in prompts]
    finally:
        engine.prefix_cache.max_bytes = saved
    readers = [submit(engine, ids, 12) for ids in prompts]
    results = [body(reader) for reader in readers]
    assert [text(r) for r in results] == reference
    assert all(r["usage"]["cache_read_input_tokens"] > 0 for r in results)


def test_a_reader_that_never_reads_is_cancelled_and_the_others_go_on(smollm: LoadedModel) -> None:
    tok = smollm.tokenizer
    vocab = tok.native_vocab()
    engine = Engine(
        smollm, Router(vocab, max_unread_bytes=512), EngineSettings(stall_timeout_s=0.5)
    )
    engine.start()
    try:
        story = prompt_ids(engine, "Write a very long story about a dragon.")
        stalled = submit(engine, story, 2000, stream=True)  # never read until the end
        slow = submit(engine, story, 60, stream=True)  # read now and then: it may lag, not stall
        normal = submit(engine, prompt_ids(engine, QUESTIONS[0]), 24)
        received = b""
        while (data := slow.take()) is not None:
            received += data
            time.sleep(0.1)  # lags behind (frames coalesce) but keeps reading
        assert "Paris" in text(body(normal))
        assert received.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
        wait_until(lambda: engine.metrics.requests_cancelled >= 1, 60.0)
        wait_until(lambda: engine.metrics.running == 0, 60.0)
        frames = b""
        while (data := stalled.take()) is not None:
            frames += data
        assert b"event: error" in frames and b"stopped reading" in frames
        assert stalled.unread_bytes == 0
    finally:
        engine.stop()


def test_a_burst_past_one_pass_starts_from_the_prefix_its_first_prompts_stored(
    smollm: LoadedModel,
) -> None:
    """Prompts that share a prefix arrive at once, more than one pass takes (the idle step's
    budget: two of them): those left waiting were looked up before anything was cached, and
    look again once the first two stored their prompts as they joined: they compute only their
    own ends, and answer exactly as computed whole."""
    engine = make_engine(smollm, max_prefill_tokens=256)
    try:
        shared = "Answer briefly and precisely. " * 15
        prompts = [prompt_ids(engine, shared + q) for q in QUESTIONS[:6]]
        engine.prefix_cache.max_bytes, saved = 0, engine.prefix_cache.max_bytes
        try:
            reference = [text(body(submit(engine, ids, 8))) for ids in prompts]
        finally:
            engine.prefix_cache.max_bytes = saved
        with engine.admission._wakeup:  # queued together: the engine takes them in one step
            readers = [submit(engine, ids, 8) for ids in prompts]
        results = [body(reader) for reader in readers]
    finally:
        engine.stop()
    assert [text(r) for r in results] == reference
    cached = [r["usage"]["cache_read_input_tokens"] for r in results]
    assert sorted(cached)[:3] == [0, 0, min(c for c in cached if c)], cached
    assert sum(c >= 60 for c in cached) == 4, cached
