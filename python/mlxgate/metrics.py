"""What /metrics shows of the engine: its own metrics (engine/metrics.py), and the memory, the
streams and the prefix cache's tiers read at scrape time."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import mlx.core as mx
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from mlxgate.engine import Engine
from mlxgate.engine.disk_cache import DiskStats


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
        yield from self._prefix_cache_tiers()

    def _prefix_cache_tiers(self) -> Iterator[Metric]:
        disk = self.engine.prefix_cache.disk
        stats = DiskStats()
        if disk is not None:
            with disk.lock:
                stats = dataclasses.replace(disk.stats)
        hits = CounterMetricFamily(
            "mlxgate_prefix_cache_hit_tokens",
            "prompt tokens reused from the prefix cache, by the tier they came from",
            labels=["tier"],
        )
        m = self.engine.metrics
        hits.add_metric(["memory"], m.cache_hit_tokens - stats.hit_tokens - m.inflight_hit_tokens)
        hits.add_metric(["disk"], stats.hit_tokens)
        # Another prompt's prefill, waited for instead of computed again.
        hits.add_metric(["in-flight"], m.inflight_hit_tokens)
        yield hits
        if disk is None:
            return
        name = "mlxgate_prefix_cache_disk_"
        for field, doc in (
            ("bytes", "bytes of the prefix cache's directory (every model's files)"),
            ("files", "files in the prefix cache's directory (every model's)"),
        ):
            yield GaugeMetricFamily(name + field, doc, value=getattr(stats, field))
        for field, doc in (
            ("written_files", "blocks or snapshots the prefix cache wrote to disk"),
            ("written_bytes", "bytes the prefix cache wrote to disk"),
            ("write_s", "seconds the prefix cache's disk writer spent writing"),
            ("read_files", "blocks or snapshots the prefix cache read from disk"),
            ("read_bytes", "bytes the prefix cache read from disk"),
            ("read_s", "seconds the prefix cache's disk reader spent reading"),
            ("damaged_files", "prefix cache files found damaged on reading (deleted, not used)"),
        ):
            yield CounterMetricFamily(name + field, doc, value=getattr(stats, field))
