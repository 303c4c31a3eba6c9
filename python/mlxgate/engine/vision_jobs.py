"""Prompts' images through a vision model's vision tower, on a thread beside the engine's steps.

On a CPU a vision tower takes seconds to minutes an image (a 640x480 screenshot through
Qwen2.5-VL 3B's: 15 s here; through Gemma 3's SigLIP at 896x896: 116 s). Run inside a step, it
would hold every decoding stream that long. On its own thread, taking turns with the engine's
steps part by part (a block's attention, its MLP), the decoding streams go on meanwhile at
about half their pace; the prompt waits, its keep-alives sent, and starts its prefill once its
features are made. MLX evaluates each thread's arrays on that thread's own stream: the job's
arrays are made and evaluated here, and the engine thread only reads the evaluated results.

A job whose clients left is abandoned: the tower stops after its current part.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxgate.engine.contract import PromptImages
    from mlxgate.models.vision import Features, VisionAdapter

log = logging.getLogger(__name__)


@dataclass(eq=False)
class VisionJob:
    ids: list[int]  # the whole prompt
    images: PromptImages
    done: threading.Event = field(default_factory=threading.Event)
    abandoned: bool = False  # its clients left: stop after the current block
    features: Features | None = None  # once done, unless abandoned or failed
    error: str | None = None  # why it failed, if it did
    seconds: float = 0.0  # the tower's time

    def is_abandoned(self) -> bool:
        return self.abandoned


class VisionJobs:
    """One thread running jobs in order; `wake` is called as each finishes. Each part of a tower
    (a block's attention, its MLP) is computed within a `turn`, as the engine's steps are: the
    two share the cores by time (two computations at once, each on every core, slow both by far
    more than half)."""

    def __init__(
        self,
        adapter: VisionAdapter,
        wake: Callable[[], None],
        turn: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self.adapter = adapter
        self._wake = wake
        self._turn = turn
        self._jobs: queue.SimpleQueue[VisionJob | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="mlxgate-vision", daemon=True)
        self._thread.start()

    def submit(self, ids: list[int], images: PromptImages) -> VisionJob:
        job = VisionJob(ids, images)
        self._jobs.put(job)
        return job

    def stop(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if not job.abandoned:
                started = time.perf_counter()
                try:
                    job.features = self.adapter.features(
                        job.ids, job.images.inputs, job.is_abandoned, self._turn
                    )
                except Exception as exc:
                    log.exception("the vision tower failed")
                    job.error = f"{type(exc).__name__}: {exc}"
                job.seconds = time.perf_counter() - started
            job.done.set()
            self._wake()
