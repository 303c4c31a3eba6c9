"""Admission: requests from the API's threads, checked, opened and queued for the engine thread.

`admit` never blocks: a request is refused at once (an AdmissionError: a prompt too long for the
context or the KV memory budget, a full queue, a stopped engine), or its response is opened on
the router and the request queued; the engine thread takes the queue between two steps.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import deque
from collections.abc import Callable

from mlxgate._native import Reader, Router
from mlxgate.engine.contract import EngineStopped, GenerationRequest, PromptTooLong, QueueFull
from mlxgate.engine.kv_memory import KVMemory
from mlxgate.engine.metrics import EngineMetrics
from mlxgate.engine.prefill import Pending
from mlxgate.engine.prefix_cache import PrefixCache
from mlxgate.engine.settings import EngineSettings
from mlxgate.models import LoadedModel


class Admission:
    """The queue between the API's threads and the engine thread."""

    def __init__(
        self,
        loaded: LoadedModel,
        settings: EngineSettings,
        memory: KVMemory,
        prefix_cache: PrefixCache,
        metrics: EngineMetrics,
        router: Callable[[], Router],
        *,
        look_up: bool,
    ) -> None:
        """`router`: the engine's (looked up at each call: tests swap it). `look_up`: whether
        admission looks each prompt up in the prefix cache (with ranks, the engine thread does:
        every rank at the same point of the schedule)."""
        self.loaded = loaded
        self.settings = settings
        self.memory = memory
        self.prefix_cache = prefix_cache
        self.metrics = metrics
        self.router = router
        self.look_up = look_up
        self.accepting = threading.Event()
        self._ids = itertools.count(1)
        self._incoming: deque[Pending] = deque()
        self._wakeup = threading.Condition()

    def admit(self, request: GenerationRequest) -> Reader:
        """Open the request's response and queue it, or raise an AdmissionError. The choices of
        OpenAI's `n` are one sequence, prefilled once; each then decodes on its own copy of the
        cache, into the one response."""
        if not self.accepting.is_set():
            raise EngineStopped()
        prompt_ids = request.prompt_ids
        prompt_tokens = len(prompt_ids)
        context = self.loaded.context_length
        if prompt_tokens >= context:  # at least one token must fit after the prompt
            raise PromptTooLong(prompt_tokens, context)
        if self.memory.need(prompt_tokens + 1) > self.memory.budget:
            raise PromptTooLong(prompt_tokens, self.memory.most_tokens() - 1, memory=True)
        queued = len(self._incoming) + self.metrics.queue_depth
        if queued >= self.settings.max_queued:
            raise QueueFull(retry_after_s=1 + queued // 8)
        served = self.loaded.context
        window = served.window(prompt_tokens, request.max_tokens) if served else context
        scaled = window > (served.native if served else context)
        # One lookup for every choice: a match is immutable, and each start copies its caches.
        # (With ranks, every rank looks up as the engine refreshes its waiting prompts.)
        # Without a lookup here, the engine's first lookup is its refresh (`looked_at` 0).
        looked_at = self.prefix_cache.stores if self.look_up else 0
        match = (
            self.prefix_cache.lookup(request.cache_keys(), variant=int(scaled))
            if self.look_up
            else None
        )
        cached = match.length if match else 0
        choices = [
            Pending(
                next(self._ids),
                _choice(request, index),
                match,
                scaled,
                reported=cached,
                looked_at=looked_at,
            )
            for index in range(request.choices)
        ]
        # Choices decode together; where they cannot (more than may run at once), each is a
        # sequence of its own, the prefix cache sharing what it can.
        together = len(choices) <= self.settings.max_running
        # Opened and queued as one: a cancel the engine polls finds the request somewhere.
        with self._wakeup:
            reader = self.router().open(
                [pending.stream_id for pending in choices],
                request.stream,
                prompt_tokens=prompt_tokens,
                cached_tokens=cached,
                cached_from=match.tier if match is not None else "",
                max_tokens=min(request.max_tokens or window, window - prompt_tokens),
                loop_span=self.settings.loop_guard_tokens if request.loop_guard else 0,
            )
            if together:
                choices[0].siblings = choices[1:]
                self._incoming.append(choices[0])
            else:
                self._incoming.extend(choices)
            self._wakeup.notify()
        return reader

    def __len__(self) -> int:
        return len(self._incoming)

    def held(self) -> list[Pending]:
        """The queued sequences (any thread)."""
        return list(self._incoming)

    def take(self) -> list[Pending]:
        """Everything queued since the last take (the engine thread, between steps)."""
        with self._wakeup:
            taken = list(self._incoming)
            self._incoming.clear()
        return taken

    def wait(self, timeout: Callable[[], float | None]) -> None:
        """Sleep until a request is queued or `notify` is called, at most `timeout()` seconds
        (asked under the queue's lock, so that a request queued meanwhile is not missed; None:
        do not sleep)."""
        with self._wakeup:
            if (seconds := timeout()) is not None:
                self._wakeup.wait(seconds)

    def notify(self) -> None:
        with self._wakeup:
            self._wakeup.notify()


def _choice(request: GenerationRequest, index: int) -> GenerationRequest:
    """Choice `index` of the request: with a seed, its own seed."""
    seed = request.sampling.seed
    if index == 0 or seed is None:
        return request
    return dataclasses.replace(
        request, sampling=dataclasses.replace(request.sampling, seed=seed + index)
    )
