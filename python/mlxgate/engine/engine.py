"""The engine thread: the only thread that touches MLX; turns admitted requests into token steps."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxgate._native import Reader, Router
from mlxgate.engine.errors import EngineStopped, PromptTooLong, QueueFull
from mlxgate.engine.request import GenerationRequest
from mlxgate.engine.sampling import Sampler
from mlxgate.models import LoadedModel

log = logging.getLogger("mlxgate.engine")

# Router finish codes (see _native.pyi: Router.step).
RUNNING, END_TURN, MAX_TOKENS = 0, 1, 2


@dataclass
class _Sequence:
    stream_id: int
    request: GenerationRequest
    admitted_at: float = field(default_factory=time.monotonic)


class Engine:
    """Owns the model on one thread. `submit` returns a stream reader at once, never blocks."""

    def __init__(
        self,
        loaded: LoadedModel,
        router: Router,
        *,
        max_queued: int = 64,
        prefill_chunk: int = 256,
    ) -> None:
        self.loaded = loaded
        self.router = router
        self.prefill_chunk = prefill_chunk
        # Router calls come from the event loop (open) and this thread (step); the lock is never
        # held while waiting on anything but the router itself.
        self._router_lock = threading.Lock()
        self._queue: queue.Queue[_Sequence] = queue.Queue(maxsize=max_queued)
        self._ids = itertools.count(1)
        self._cancelled_ids: set[int] = set()
        self._running = threading.Event()
        self._thread: threading.Thread | None = None
        self.eos_ids = loaded.tokenizer.eos_ids

    @property
    def context_length(self) -> int:
        return self.loaded.context_length

    def check_prompt(self, prompt_tokens: int) -> None:
        # At least one token must fit after the prompt.
        if prompt_tokens >= self.context_length:
            raise PromptTooLong(prompt_tokens, self.context_length)

    def max_new_tokens(self, prompt_tokens: int, requested: int) -> int:
        """Clamp `max_tokens` to what fits in the context after the prompt."""
        return max(1, min(requested, self.context_length - prompt_tokens))

    def submit(self, request: GenerationRequest, open_stream: Callable[[int], Reader]) -> Reader:
        """Admit a request; `open_stream(stream_id)` opens its protocol stream in the router."""
        if not self._running.is_set():
            raise EngineStopped()
        self.check_prompt(len(request.prompt_ids))
        request.max_tokens = self.max_new_tokens(len(request.prompt_ids), request.max_tokens)
        if self._queue.full():
            raise QueueFull(retry_after_s=1 + self._queue.qsize() // 4)
        stream_id = next(self._ids)
        with self._router_lock:
            reader = open_stream(stream_id)
        try:
            self._queue.put_nowait(_Sequence(stream_id, request))
        except queue.Full:
            with self._router_lock:
                self.router.close(stream_id)
            raise QueueFull(retry_after_s=1) from None
        return reader

    def start(self) -> None:
        self._running.set()
        self._thread = threading.Thread(target=self._run, name="mlxgate-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._running.clear()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while self._running.is_set():
            try:
                seq = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                self._generate(seq)
            except Exception as exc:
                log.exception("generation failed for stream %d", seq.stream_id)
                with self._router_lock:
                    self.router.fail(seq.stream_id, "api_error", f"generation failed: {exc}")

    def _cancelled(self, stream_id: int) -> bool:
        """Whether the client of `stream_id` went away (the router has already dropped it)."""
        with self._router_lock:
            self._cancelled_ids.update(self.router.cancelled())
        if stream_id in self._cancelled_ids:
            self._cancelled_ids.discard(stream_id)
            return True
        return False

    def _generate(self, seq: _Sequence) -> None:
        model = self.loaded.model
        request = seq.request
        cache = make_prompt_cache(model)
        prompt = request.prompt_ids
        sampler = Sampler(request.sampling)

        # Prefill all but the last prompt token in chunks, so a cancel lands between chunks.
        for start in range(0, len(prompt) - 1, self.prefill_chunk):
            if self._cancelled(seq.stream_id):
                return
            chunk = prompt[start : min(start + self.prefill_chunk, len(prompt) - 1)]
            model(mx.array(chunk)[None], cache=cache)
            mx.eval([c.state for c in cache])

        token = mx.array(prompt[-1:])
        for produced in range(1, request.max_tokens + 1):
            logits = model(token[None], cache=cache)[:, -1, :]
            token = sampler(logits)
            token_id: int = token.item()  # type: ignore[assignment]
            if token_id in self.eos_ids:
                code = END_TURN
            elif produced == request.max_tokens:
                code = MAX_TOKENS
            else:
                code = RUNNING
            with self._router_lock:
                ended = self.router.step([seq.stream_id], [token_id], [code])
            if code != RUNNING or seq.stream_id in ended:
                return
