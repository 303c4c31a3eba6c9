"""Counters and latency samples the engine keeps; read by /metrics and the benchmarks."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field


@dataclass
class EngineMetrics:
    queue_depth: int = 0
    running: int = 0
    steps: int = 0
    prefill_tokens: int = 0
    prefill_passes: int = 0  # forward passes; one may carry several prompts
    decode_tokens: int = 0
    cache_hit_tokens: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    # Speculative decoding: passes that checked guesses, guessed tokens, guesses kept.
    verify_passes: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    heap_trims: int = 0  # free heap pages given back to the system (engine/heap.py)
    heap_trim_s: float = 0.0
    last_step_s: float = 0.0
    busy_s: float = 0.0
    # Recent samples (seconds), bounded.
    ttft_s: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    step_s: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def snapshot(self) -> dict[str, float | int]:
        with self.lock:
            ttft = sorted(self.ttft_s)
            steps = sorted(self.step_s)

        def pct(values: list[float], q: float) -> float:
            return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0

        return {
            "queue_depth": self.queue_depth,
            "running": self.running,
            "steps": self.steps,
            "prefill_tokens": self.prefill_tokens,
            "prefill_passes": self.prefill_passes,
            "decode_tokens": self.decode_tokens,
            "cache_hit_tokens": self.cache_hit_tokens,
            "requests_finished": self.requests_finished,
            "requests_cancelled": self.requests_cancelled,
            "verify_passes": self.verify_passes,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.drafted_tokens
            if self.drafted_tokens
            else 0.0,
            "busy_s": self.busy_s,
            "heap_trims": self.heap_trims,
            "heap_trim_s": self.heap_trim_s,
            "ttft_p50_s": pct(ttft, 0.5),
            "ttft_p95_s": pct(ttft, 0.95),
            "step_p50_s": pct(steps, 0.5),
            "step_p95_s": pct(steps, 0.95),
            "step_max_s": steps[-1] if steps else 0.0,
        }
