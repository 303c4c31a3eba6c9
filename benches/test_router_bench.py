"""One engine step of 1, 32 and 256 open streams: the Rust router vs the best pure-Python path.

    make bench-router        (pytest benches/test_router_bench.py --benchmark-enable)

Both routers get the step as the engine passes it (numpy arrays of stream ids and token ids)
for streams past message_start that are streaming text deltas; each router decides itself
whether a token ends its stream (the model's end-of-turn ids, max_tokens, stop sequences). The
engine thread's call is what is timed; between rounds the event loop delivers, and every reader
takes its frames.

Two reader states, both common under load. `waiting`: every reader is parked, like an asyncio
task awaiting its next frame, with its loop's one `wake_all` (as `mlxgate.api.reader` parks them);
the Rust router wakes them all with one `call_soon_threadsafe`, the Python path hands the whole
step to the loop with one `call_soon_threadsafe` (its wakes run on the loop, untimed). `behind`:
no reader is parked (each still has frames to send), so frames only queue.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import orjson
import pytest
from pure_python_stream import PyRouter, mlx_lm_tokenizer
from stream_workload import GENERATED_TEXT, STOP_SEQUENCES, Workload, load_workload

from mlxgate._native import FinishReason, Reply, Router, StreamSpec
from mlxgate.api.reader import wake_all_for

STREAM_COUNTS = [1, 32, 256]
PATHS = ["rust", "python"]
WARMUP_STEPS = 8  # past message_start, ping and content_block_start
ROUNDS = 300  # mlx-lm's detokenizer keeps each stream's whole text: stay near a real length
WARMUP_ROUNDS = 10
# More than a benchmark steps: no stream ends while it is timed.
BENCH_MAX_TOKENS = 2 * (WARMUP_STEPS + WARMUP_ROUNDS + ROUNDS)


@pytest.fixture(scope="session")
def workload() -> Workload:
    return load_workload()


@pytest.fixture(scope="session")
def python_router_tokenizer(workload: Workload) -> Any:
    return mlx_lm_tokenizer(workload.loaded.tokenizer)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def make_router(
    path: str, workload: Workload, tokenizer: Any, loop: asyncio.AbstractEventLoop
) -> Any:
    return Router(workload.vocab) if path == "rust" else PyRouter(tokenizer, loop=loop)


class OpenStreams:
    """Streams open on one router, each stepping through the workload text from its own place."""

    def __init__(
        self,
        router: Any,
        count: int,
        workload: Workload,
        loop: asyncio.AbstractEventLoop,
        stop_sequences: list[str] = STOP_SEQUENCES,
        max_tokens: int = BENCH_MAX_TOKENS,
    ) -> None:
        self.router = router
        self.workload = workload
        self.loop = loop
        self.wake_all = wake_all_for(loop)
        self.stream_ids = np.arange(1, count + 1, dtype=np.uint32)
        # Apart in the text, so one step mixes words, spaces, newlines and partial characters.
        self.positions = self.stream_ids.astype(np.int64) * 37
        eos_ids = sorted(workload.loaded.tokenizer.eos_ids)

        async def open_all() -> list[Any]:  # on the loop thread, as the engine's admit opens them
            return [
                router.open(
                    int(stream_id),
                    StreamSpec.anthropic(
                        model="SmolLM2-135M-Instruct",
                        message_id=f"msg_{stream_id:024d}",
                        stop_sequences=stop_sequences,
                        reply=Reply(eos_ids=eos_ids),
                    ),
                    prompt_tokens=70,
                    max_tokens=max_tokens,
                )
                for stream_id in self.stream_ids
            ]

        self.readers = loop.run_until_complete(open_all())

    def drain(self) -> list[bytes]:
        """Let the loop run what the last step queued, then take every reader's frames."""
        for _ in range(2):  # deliver, then the wakes it calls
            self.loop.run_until_complete(asyncio.sleep(0))
        return [reader.take() or b"" for reader in self.readers]

    def next_step(self, park: bool = True) -> tuple[tuple[Any, ...], dict]:
        """Drain, park every reader again (unless `park` is False); the next step's arrays."""
        self.drain()
        for reader in self.readers if park else ():
            reader.park(self.loop.create_future(), self.wake_all)
        tokens = self.workload.tokens_at(self.positions)
        self.positions += 1
        return (self.stream_ids, tokens), {}


@pytest.mark.parametrize("readers", ["waiting", "behind"])
@pytest.mark.parametrize("streams", STREAM_COUNTS)
@pytest.mark.parametrize("path", PATHS)
def test_step(
    benchmark: Any,
    path: str,
    streams: int,
    readers: str,
    workload: Workload,
    python_router_tokenizer: Any,
    loop: asyncio.AbstractEventLoop,
) -> None:
    router = make_router(path, workload, python_router_tokenizer, loop)
    open_streams = OpenStreams(router, streams, workload, loop)
    for _ in range(WARMUP_STEPS):
        router.step(*open_streams.next_step()[0])
    benchmark.group = f"one step, {streams} streams, readers {readers}"
    setup = functools.partial(open_streams.next_step, park=readers == "waiting")
    benchmark.pedantic(router.step, setup=setup, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS)


def text_and_stop(sse: bytes) -> tuple[str, Any]:
    """The streamed text and the message_delta's stop fields."""
    text, stop = "", None
    for frame in sse.split(b"\n\n"):
        if not frame:
            continue
        data = orjson.loads(frame.split(b"data: ", 1)[1])
        if data["type"] == "content_block_delta":
            text += data["delta"]["text"]
        elif data["type"] == "message_delta":
            stop = (data["delta"]["stop_reason"], data["delta"]["stop_sequence"])
    return text, stop


def run_to_end(open_streams: OpenStreams, steps: int) -> tuple[list[tuple[str, Any]], dict]:
    """Step until max_tokens (`steps`) ends every stream still open: each stream's text and
    stop fields, and how the router reported each end."""
    received = [b""] * len(open_streams.readers)
    ended: dict[int, FinishReason] = {}
    for _ in range(steps):
        ended.update(open_streams.router.step(*open_streams.next_step()[0]))
        received = [a + b for a, b in zip(received, open_streams.drain(), strict=True)]
    received = [a + b for a, b in zip(received, open_streams.drain(), strict=True)]
    assert not len(open_streams.router)
    return [text_and_stop(sse) for sse in received], ended


@pytest.mark.parametrize("stop_sequences", [STOP_SEQUENCES, ["du Port", "storm of"]])
def test_both_paths_stream_the_same_text(
    stop_sequences: list[str],
    workload: Workload,
    python_router_tokenizer: Any,
    loop: asyncio.AbstractEventLoop,
) -> None:
    steps = len(workload.token_ids)
    results, ends = {}, {}
    for path in PATHS:
        router = make_router(path, workload, python_router_tokenizer, loop)
        open_streams = OpenStreams(router, 8, workload, loop, stop_sequences, max_tokens=steps)
        results[path], ends[path] = run_to_end(open_streams, steps)
    # mlx-lm's detokenizer drops a leading space from a stream's first text.
    rust = [(text.removeprefix(" "), stop) for text, stop in results["rust"]]
    assert rust == results["python"]
    assert ends["rust"] == ends["python"]
    # The stop sequences of STOP_SEQUENCES never match: the last step ends every stream.
    matches = stop_sequences != STOP_SEQUENCES
    reason = FinishReason.STOP_SEQUENCE if matches else FinishReason.MAX_TOKENS
    assert ends["rust"] == dict.fromkeys(range(1, 9), reason)
    stopped = [stop for _, stop in results["rust"] if stop[0] == "stop_sequence"]
    assert len(stopped) == (8 if matches else 0)
    for text, _ in results["rust"]:
        assert text and text in GENERATED_TEXT * 2
