"""What /metrics shows of the engine: its own metrics (engine/metrics.py) and the memory and
streams read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from mlxgate.engine import Engine


class EngineCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.scraped = CollectorRegistry()
        gauges = {
            "mlxgate_engine_open_streams": (
                "streams the engine still holds (generating, or waiting to be read)",
                lambda: len(engine.router),
            ),
            "mlxgate_mlx_active_bytes": (
                "memory MLX holds in live arrays (weights, KV caches, activations)",
                mx.get_active_memory,
            ),
            "mlxgate_mlx_cache_bytes": (
                "memory MLX keeps from freed arrays for reuse (its buffer cache)",
                mx.get_cache_memory,
            ),
            "mlxgate_prefix_cache_bytes": (
                "memory held by the prefix KV cache",
                lambda: engine.prefix_cache.nbytes,
            ),
        }
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, registry=self.scraped).set_function(read)

    def collect(self) -> Iterator[Metric]:
        yield from self.engine.metrics.registry.collect()
        yield from self.scraped.collect()
