"""What /metrics shows of the models: each loaded model's engine metrics (engine/metrics.py) and
its streams and prefix cache tiers read at scrape time, labelled `model`; each configured
model's state, loads and memory; MLX's memory."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator

import mlx.core as mx
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from mlxgate.engine import Engine
from mlxgate.engine.disk_cache import DiskStats
from mlxgate.engine.lockstep import RankGroup
from mlxgate.registry import ModelRegistry
from mlxgate.served import State


class ModelsCollector(Collector):
    def __init__(self, models: ModelRegistry) -> None:
        self.models = models
        self.scraped = CollectorRegistry()
        for name, doc, read in (
            (
                "mlxgate_mlx_active_bytes",
                "memory MLX holds in live arrays (every model's weights, KV caches, activations)",
                mx.get_active_memory,
            ),
            (
                "mlxgate_mlx_cache_bytes",
                "memory MLX keeps from freed arrays for reuse (its buffer cache)",
                mx.get_cache_memory,
            ),
            (
                "mlxgate_models_memory_budget_bytes",
                "bytes the loaded models may hold together (--max-model-memory; 0: no limit)",
                lambda: models.memory_budget,
            ),
        ):
            Gauge(name, doc, registry=self.scraped).set_function(read)

    def collect(self) -> Iterator[Metric]:
        yield from self.scraped.collect()
        yield from self._states()
        yield from labelled(
            (entry.name, entry.served.metrics.collect())
            for entry in self.models.loaded()
            if entry.served is not None and entry.served.metrics is not None
        )

    def _states(self) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "mlxgate_model_state", "1 for each model's state", labels=["model", "state"]
        )
        memory = GaugeMetricFamily(
            "mlxgate_model_memory_bytes",
            "what a loaded model holds: weights, KV caches and prefix cache",
            labels=["model"],
        )
        loads = CounterMetricFamily("mlxgate_model_loads", "models loaded", labels=["model"])
        load_s = GaugeMetricFamily(
            "mlxgate_model_load_seconds", "the seconds a model's last load took", labels=["model"]
        )
        unloads = CounterMetricFamily(
            "mlxgate_model_unloads",
            "models unloaded, by why: idle (TTL or keep_alive), memory (room for another), "
            "request (the unload endpoint)",
            labels=["model", "reason"],
        )
        for entry in self.models.entries.values():
            for each in State:
                state.add_metric([entry.name, str(each)], float(entry.state is each))
            if entry.served is not None:
                memory.add_metric([entry.name], entry.served.footprint())
            loads.add_metric([entry.name], entry.loads)
            load_s.add_metric([entry.name], entry.load_s)
            for reason, count in entry.unloads.items():
                unloads.add_metric([entry.name, reason], count)
        yield from (state, memory, loads, load_s, unloads)


def labelled(by_model: Iterable[tuple[str, Iterable[Metric]]]) -> Iterator[Metric]:
    """Each model's metrics as one family per name, every sample labelled with its model."""
    merged: dict[str, Metric] = {}
    for model, families in by_model:
        for family in families:
            out = merged.get(family.name)
            if out is None:
                out = Metric(family.name, family.documentation, family.type, family.unit)
                merged[family.name] = out
            out.samples.extend(
                sample._replace(labels={"model": model, **sample.labels})
                for sample in family.samples
            )
    yield from merged.values()


class EngineCollector(Collector):
    """One engine's metrics (ModelsCollector labels them with its model)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.scraped = CollectorRegistry()
        gauges: dict[str, tuple[str, Callable[[], float]]] = {
            "mlxgate_engine_open_streams": (
                "streams the engine still holds (generating, or waiting to be read)",
                lambda: len(engine.router),
            ),
            "mlxgate_prefix_cache_bytes": (
                "memory held by the prefix KV cache",
                lambda: engine.prefix_cache.nbytes,
            ),
        }
        if isinstance(lockstep := engine.lockstep, RankGroup):
            gauges["mlxgate_ranks"] = (
                "processes the model is sharded across",
                lambda: lockstep.ranks,
            )
            gauges["mlxgate_rank_shares"] = (
                "decisions rank 0 has shared with the other ranks (engine/lockstep.py)",
                lambda: lockstep.shares,
            )
            gauges["mlxgate_rank_share_seconds"] = (
                "seconds rank 0's engine spent sharing its decisions (the plan's overhead)",
                lambda: lockstep.share_s,
            )
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, registry=self.scraped).set_function(read)

    def collect(self) -> Iterator[Metric]:
        yield from self.engine.metrics.registry.collect()
        yield from self.scraped.collect()
        yield from self._prefix_cache_tiers()

    def _prefix_cache_tiers(self) -> Iterator[Metric]:
        disk = self.engine.disk_cache
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
