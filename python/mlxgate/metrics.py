"""Prometheus export of the engine's own counters, read at scrape time (no per-token cost)."""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from mlxgate.engine import Engine

_GAUGES = {
    "queue_depth": "requests admitted and waiting for prefill",
    "running": "sequences in the decode batch",
    "ttft_p50_s": "median time to first token over recent requests, seconds",
    "ttft_p95_s": "95th percentile time to first token over recent requests, seconds",
    "step_p50_s": "median decode step time over recent steps, seconds",
    "step_p95_s": "95th percentile decode step time over recent steps, seconds",
    "step_max_s": "longest recent decode step, seconds",
    "acceptance_rate": "speculative decoding: guessed tokens kept / guessed tokens, since start",
}
_COUNTERS = {
    "steps": "engine steps",
    "prefill_tokens": "prompt tokens computed",
    "prefill_passes": "prefill forward passes (one may carry several prompts)",
    "decode_tokens": "tokens generated",
    "cache_hit_tokens": "prompt tokens reused from the prefix cache",
    "requests_finished": "requests that finished generating",
    "requests_cancelled": "requests whose client went away",
    "verify_passes": "speculative decoding: decode steps that checked guessed tokens",
    "drafted_tokens": "speculative decoding: tokens guessed (by prompt lookup or a draft model)",
    "accepted_tokens": "speculative decoding: guessed tokens the model confirmed",
    "busy_s": "seconds the engine spent in steps",
    "heap_trims": "times the engine gave the C heap's free pages back to the system",
    "heap_trim_s": "seconds the engine spent giving the C heap's free pages back",
}


class EngineCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snapshot = self.engine.metrics.snapshot()
        for name, doc in _GAUGES.items():
            yield GaugeMetricFamily(f"mlxgate_engine_{name}", doc, value=snapshot[name])
        for name, doc in _COUNTERS.items():
            yield CounterMetricFamily(f"mlxgate_engine_{name}", doc, value=snapshot[name])
        yield GaugeMetricFamily(
            "mlxgate_engine_open_streams",
            "streams the engine still holds (generating, or waiting to be read)",
            value=len(self.engine.router),
        )
        yield GaugeMetricFamily(
            "mlxgate_mlx_active_bytes",
            "memory MLX holds in live arrays (weights, KV caches, activations)",
            value=mx.get_active_memory(),
        )
        yield GaugeMetricFamily(
            "mlxgate_mlx_cache_bytes",
            "memory MLX keeps from freed arrays for reuse (its buffer cache)",
            value=mx.get_cache_memory(),
        )
        yield GaugeMetricFamily(
            "mlxgate_prefix_cache_bytes",
            "memory held by the prefix KV cache",
            value=self.engine.prefix_cache.nbytes,
        )
