"""A configured model's place in the registry (`ModelEntry`: its state, its use, what it holds)
and, once loaded, what answering a request needs of it (`ServedModel`)."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client.registry import Collector

from mlxgate.engine import GenerationEngine, SamplingParams
from mlxgate.specs import ModelSpec

if TYPE_CHECKING:  # (types only: `mlxgate --help` and granian's main process load no MLX)
    from mlxgate import prompts
    from mlxgate.api.vision_prompts import VisionPrompts


class State(enum.StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"


@dataclass
class ServedModel:
    """A loaded model: what answering a request needs."""

    name: str
    engine: GenerationEngine
    renderer: prompts.Renderer
    context_length: int
    weights_bytes: int = 0  # as MLX holds them
    # The engine's KV caches and prefix cache, as MLX holds them (0 for a stand-in engine).
    cache_bytes: Callable[[], int] = lambda: 0
    metrics: Collector | None = None  # what /metrics shows of its engine
    # How its prompts take images (a vision-language model); None: it reads text only.
    vision: VisionPrompts | None = None
    # What a request that leaves a sampling parameter unset gets, and where each came from.
    sampling: SamplingParams = field(default_factory=SamplingParams)
    sampling_sources: dict[str, str] = field(default_factory=dict)

    def footprint(self) -> int:
        return self.weights_bytes + self.cache_bytes()


@dataclass
class ModelEntry:
    spec: ModelSpec
    state: State = State.UNLOADED
    served: ServedModel | None = None
    loading: asyncio.Future[ServedModel] | None = None
    last_used: float = field(default_factory=time.monotonic)
    # A request's keep_alive: unloaded this long after it goes idle (overrides the TTL).
    keep_alive_s: float | None = None
    unload_asked: bool = False  # the unload endpoint asked while it had streams: once idle
    # While loading: what it will hold, as estimated before its load (the budget counts it).
    need: int = 0
    loads: int = 0
    unloads: dict[str, int] = field(default_factory=dict)  # by reason
    load_s: float = 0.0  # the last load's seconds

    @property
    def name(self) -> str:
        return self.spec.name

    def busy(self) -> bool:
        return self.served is not None and self.served.engine.busy()

    def idle_ttl(self) -> float | None:
        """Idle seconds after which it is unloaded; None: it stays."""
        if self.unload_asked:
            return 0.0
        if self.forever():
            return None
        if self.keep_alive_s is not None:
            return self.keep_alive_s
        return self.spec.ttl_s if self.spec.ttl_s > 0 else None

    def forever(self) -> bool:
        """Never unloaded: pinned (the default model is), or a request's negative keep_alive."""
        return self.spec.pinned or (self.keep_alive_s is not None and self.keep_alive_s < 0)
