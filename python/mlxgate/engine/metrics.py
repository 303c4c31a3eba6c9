"""The engine's metrics, each declared once: Prometheus counters, gauges and latency histograms in a
registry of the engine's own (the app serves it on /metrics), also readable as attributes
(`metrics.prefill_tokens`) by tests and benchmarks.

The engine thread records per step or per request, never per token: `metrics.steps += 1` adds
to a counter, `metrics.running = n` sets a gauge, `metrics.ttft_s.append(s)` observes a latency.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "mlxgate_engine_"

# Bucket bounds (seconds): a first token waits on the queue and a whole prefill; a decode step is
# one pass over the running rows.
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
STEP_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2, 5)


class _Field:
    """A number kept as an attribute and mirrored into a Prometheus metric of the same name."""

    def __init__(self, doc: str, zero: float = 0) -> None:
        self.doc = doc
        self.zero = zero  # 0 counts, 0.0 sums seconds
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, metrics: EngineMetrics | None, owner: type) -> Any:
        if metrics is None:
            return self
        return metrics._values.get(self.name, self.zero)

    def __set__(self, metrics: EngineMetrics, value: float) -> None:
        previous = metrics._values.get(self.name, self.zero)
        metrics._values[self.name] = value
        self.record(self.series(metrics, metrics._metrics[self.name]), previous, value)

    def declare(self, registry: CollectorRegistry) -> Counter | Gauge:
        raise NotImplementedError

    def series(self, metrics: EngineMetrics, metric: Any) -> Any:
        """The series of `metric` a change goes to: the metric itself, unlabelled."""
        return metric

    def record(self, metric: Any, previous: float, value: float) -> None:
        raise NotImplementedError


class Count(_Field):
    """A counter: `metrics.NAME += n` adds n to `mlxgate_engine_NAME_total`."""

    def declare(self, registry: CollectorRegistry) -> Counter:
        return Counter(PREFIX + self.name, self.doc, registry=registry)

    def record(self, metric: Counter, previous: float, value: float) -> None:
        metric.inc(value - previous)


class DrafterCount(Count):
    """A speculation counter, labelled with what guesses (`metrics.drafter`)."""

    def declare(self, registry: CollectorRegistry) -> Counter:
        return Counter(PREFIX + self.name, self.doc, ["drafter"], registry=registry)

    def series(self, metrics: EngineMetrics, metric: Any) -> Any:
        return metric.labels(drafter=metrics.drafter)


class Level(_Field):
    """A gauge: `metrics.NAME = n` sets `mlxgate_engine_NAME`."""

    def declare(self, registry: CollectorRegistry) -> Gauge:
        return Gauge(PREFIX + self.name, self.doc, registry=registry)

    def record(self, metric: Gauge, previous: float, value: float) -> None:
        metric.set(value)


class Latency:
    """A histogram of seconds, `mlxgate_engine_<name>_seconds`: `append` one sample, `extend`
    several (the interface of the sample lists it replaces)."""

    def __init__(self, histogram: Histogram, then: Callable[[], None] | None = None) -> None:
        self.histogram = histogram
        self.then = then  # called after each sample
        self.count = 0

    def append(self, seconds: float) -> None:
        self.histogram.observe(seconds)
        self.count += 1
        if self.then is not None:
            self.then()

    def extend(self, samples: Iterable[float]) -> None:
        for seconds in samples:
            self.append(seconds)


class EngineMetrics:
    """What the engine counts, its queue, and its latencies."""

    steps = Count("engine steps")
    prefill_tokens = Count("prompt tokens computed")
    prefill_passes = Count("prefill forward passes (one may carry several prompts)")
    decode_tokens = Count("tokens generated")
    cache_hit_tokens = Count("prompt tokens reused from the prefix cache")
    inflight_hit_tokens = Count(
        "prompt tokens reused from another prompt's prefill, waited for instead of computed again"
    )
    reply_tokens_kept = Count(
        "tokens of finished replies kept in the prefix cache for the conversation's next turn"
    )
    preemptions = Count(
        "decoding sequences preempted to keep the KV memory budget (resumed from the prefix cache)"
    )
    requests_finished = Count("requests that finished generating")
    requests_cancelled = Count("requests whose client went away")
    loop_stops = Count("replies the loop guard ended because they repeated themselves")
    verify_passes = DrafterCount("speculative decoding: decode steps that checked guessed tokens")
    drafted_tokens = DrafterCount(
        "speculative decoding: tokens guessed (by prompt lookup or a draft model)"
    )
    accepted_tokens = DrafterCount("speculative decoding: guessed tokens the model confirmed")
    busy_s = Count("seconds the engine spent in steps", 0.0)
    plan_s = Count("seconds rank 0 spent planning steps (engine/scheduler.py)", 0.0)
    heap_trims = Count("times the engine gave the C heap's free pages back to the system")
    heap_trim_s = Count("seconds the engine spent giving the C heap's free pages back", 0.0)
    queue_depth = Level("requests admitted and waiting for prefill")
    running = Level("sequences in the decode batch")
    kv_bytes = Level("bytes the decode batch's and the prefilling prompts' KV caches hold")
    kv_budget_bytes = Level("the KV memory budget (--kv-memory-gb)")

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._values: dict[str, float] = {}
        self.drafter = "none"  # what guesses (`guessing`): the label of the speculation counts
        self._metrics: dict[str, Counter | Gauge] = {
            name: field.declare(self.registry)
            for name, field in vars(type(self)).items()
            if isinstance(field, _Field)
        }
        Gauge(
            PREFIX + "acceptance_rate",
            "speculative decoding: guessed tokens kept / guessed tokens, since start",
            registry=self.registry,
        ).set_function(self._acceptance_rate)
        self.ttft_s = self._latency("ttft", "time from admission to the first token")
        self.queue_wait_s = self._latency("queue_wait", "time from admission to prefill's start")
        self.vision_s = self._latency(
            "vision", "a prompt's images through the vision tower (vision models)"
        )
        self.step_s = self._latency(
            "step", "decode step time (with the prefill beside it)", then=self._decoded
        )
        self.inter_token_s = self._latency(
            "inter_token",
            "time between two decode steps a stream takes part in (a step may give a row more "
            "than one token when guesses are kept)",
        )
        self.last_step_s = 0.0
        self._last_decode: tuple[int, float] | None = None  # (step number, when it ended)
        self.lock = threading.Lock()  # the engine's, around updates that go together

    def _latency(self, name: str, doc: str, then: Callable[[], None] | None = None) -> Latency:
        buckets = STEP_BUCKETS if name in ("step", "inter_token") else WAIT_BUCKETS
        name = f"{PREFIX}{name}_seconds"
        return Latency(Histogram(name, doc, buckets=buckets, registry=self.registry), then)

    def stepped(self, seconds: float, decoded: bool) -> None:
        """A step ended after `seconds`; `decoded`: whether it decoded running streams."""
        with self.lock:
            self.steps += 1
            self.last_step_s = seconds
            self.busy_s += seconds
            if decoded:
                self.step_s.append(seconds)

    def _decoded(self) -> None:
        """A decode step ended: the rows that decoded in the previous step too waited the time
        since its end for their next token (when no step without decoding came between). The
        engine counts a step in `steps` before it appends the step's time."""
        now = time.perf_counter()
        if self._last_decode is not None and self.steps == self._last_decode[0] + 1:
            self.inter_token_s.append(now - self._last_decode[1])
        self._last_decode = (self.steps, now)

    def guessing(self, drafter: str) -> None:
        """What guesses for this engine ("none" where speculation is off): the speculation
        counters' label, each at 0 until counted."""
        self.drafter = drafter
        for name in ("verify_passes", "drafted_tokens", "accepted_tokens"):
            setattr(self, name, getattr(self, name))

    def _acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def snapshot(self) -> dict[str, float]:
        """Every counter and gauge by its attribute name, and the acceptance rate."""
        values = {name: getattr(self, name) for name in self._metrics}
        return values | {"acceptance_rate": self._acceptance_rate()}

    def __repr__(self) -> str:
        return f"EngineMetrics({self.snapshot()})"
