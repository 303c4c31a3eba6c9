"""The engine over a random-weight tiny model, in-process, and mlx-lm's own greedy output to hold
it to (tests/test_architectures.py, tests/test_kv_memory.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import orjson

import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
from mlxgate._native import Reader, Reply, Router, StreamSpec, Vocab
from mlxgate.engine import Engine, EngineSettings, GenerationRequest
from mlxgate.models import LoadedModel
from mlxgate.models.context import ServedContext
from mlxgate.models.cpu import install_kernels
from support.tiny_models import VOCAB

# Log-probability gap within which two tokens tie: float32 rounding of different matmul shapes
# moves logits by ~1e-6; a wrong computation moves them by whole units.
TIE = 1e-4
STEPS = 12


@dataclass
class Expected:
    tokens: list[int]
    logprobs: list[np.ndarray]


def reference(model: Any, prompt: list[int], steps: int = STEPS, **options: Any) -> Expected:
    """mlx-lm's greedy tokens (`options`: more of `generate_step`'s, such as its logits
    processors) and the log-probabilities it chose them from."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out = Expected([], [])
    for token, logprobs in generate_step(mx.array(prompt), model, max_tokens=steps, **options):
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


class Oracle:
    """Guesses each sequence's reference continuation, every `spoil`-th position wrong (where,
    depends on the prompt's length)."""

    def __init__(self, spoil: int = 5) -> None:
        self.spoil = spoil
        self.answers: dict[tuple[int, ...], list[int]] = {}

    def expect(self, prompt: list[int], tokens: list[int]) -> None:
        self.answers[tuple(prompt)] = tokens

    def __call__(self, tokens: np.ndarray, k: int) -> np.ndarray:
        for prompt, answer in self.answers.items():
            if tuple(tokens[: len(prompt)].tolist()) == prompt:
                done = len(tokens) - len(prompt)
                guess = np.array(answer[done : done + k], dtype=np.int64)
                phase = len(prompt)  # rows keep different numbers of guesses in one pass
                for i in range(len(guess)):
                    if (done + i + phase) % self.spoil == self.spoil - 1:
                        guess[i] = (guess[i] + 1) % VOCAB
                return guess
        return np.zeros(0, dtype=np.int64)


@contextmanager
def guessing(arch: str, quantization: str | None = None) -> Iterator[tuple[Served, Any, Oracle]]:
    """A tiny `arch` model served with every row guessing from an oracle (verify passes of up to
    64 rows at once), the same weights for mlx-lm, and the oracle."""
    from support.tiny_models import twins

    served_model, reference_model = twins(arch, quantization)
    served = Served(served_model, max_prefill_chunk=16, speculation_max_rows=64, prefix_cache_mb=0)
    oracle = Oracle()
    assert served.engine.speculation is not None
    served.engine.speculation.propose = oracle
    try:
        yield served, reference_model, oracle
    finally:
        served.engine.stop()


def _every_guess(rows: Sequence[Sequence[float]], running: int, slots: int) -> int:
    return max((len(kept) - 1 for kept in rows), default=0)


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
        # Every row's guesses are verified, whatever a tiny model's noisy passes say they cost:
        # these tests are of what verify passes emit (what pays is tests/test_scheduler.py's).
        self.engine.scheduler.guesses = _every_guess  # type: ignore[method-assign]
        self.engine.start()

    def submit(self, prompt: list[int], steps: int = STEPS, **request: Any) -> Reader:
        """`request`: more of GenerationRequest's fields (its sampling, say)."""
        spec = StreamSpec.anthropic(
            model="tiny",
            message_id="msg_t",
            stream=False,
            stop_sequences=[],
            reply=Reply(eos_ids=[]),
        )
        return self.engine.admit(GenerationRequest(prompt, spec, steps, **request))

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
    def body(reader: Reader, timeout_s: float = 120.0) -> dict[str, Any]:
        """The non-streamed body, waiting on the reader the way the event loop does."""
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
