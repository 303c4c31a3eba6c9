"""The engine's metrics (engine/metrics.py): what the engine records, as Prometheus reads it."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mlxgate.engine.metrics import EngineMetrics


def scraped(metrics: EngineMetrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {
        sample.name + str(sorted(sample.labels.items()) or ""): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_counters_and_gauges_read_as_attributes_and_scrape_as_prometheus() -> None:
    m = EngineMetrics()
    m.prefill_tokens += 100
    m.prefill_tokens += 28
    m.busy_s += 0.25
    m.running = 3
    m.running = 2
    m.drafted_tokens += 8
    m.accepted_tokens += 6
    assert (m.prefill_tokens, m.busy_s, m.running, m.steps) == (128, 0.25, 2, 0)
    values = scraped(m)
    assert values["mlxgate_engine_prefill_tokens_total"] == 128
    assert values["mlxgate_engine_busy_s_total"] == 0.25
    assert values["mlxgate_engine_running"] == 2
    assert values["mlxgate_engine_steps_total"] == 0
    assert values["mlxgate_engine_acceptance_rate"] == 0.75
    snapshot = m.snapshot()
    assert snapshot["prefill_tokens"] == 128 and snapshot["acceptance_rate"] == 0.75
    assert {"queue_depth", "heap_trims", "verify_passes"} <= set(snapshot)


def test_latencies_are_histograms() -> None:
    m = EngineMetrics()
    m.ttft_s.extend([0.02, 0.3, 4.0])
    m.queue_wait_s.append(0.001)
    values = scraped(m)
    assert values["mlxgate_engine_ttft_seconds_count"] == 3
    assert abs(values["mlxgate_engine_ttft_seconds_sum"] - 4.32) < 1e-9
    assert values["mlxgate_engine_ttft_seconds_bucket[('le', '0.025')]"] == 1
    assert values["mlxgate_engine_ttft_seconds_bucket[('le', '0.5')]"] == 2
    assert values["mlxgate_engine_ttft_seconds_bucket[('le', '+Inf')]"] == 3
    assert values["mlxgate_engine_queue_wait_seconds_count"] == 1


def test_inter_token_time_is_between_decode_steps_in_a_row() -> None:
    m = EngineMetrics()

    def step(decoding: bool) -> None:  # as the engine records a step
        m.steps += 1
        if decoding:
            m.step_s.append(0.01)

    step(True)
    step(True)
    step(True)
    step(False)  # the batch ran empty: the next decode step starts new rows
    step(True)
    step(True)
    assert m.step_s.count == 5
    assert m.inter_token_s.count == 3
    assert scraped(m)["mlxgate_engine_inter_token_seconds_count"] == 3


def test_each_engine_has_its_own_registry() -> None:
    first, second = EngineMetrics(), EngineMetrics()
    first.decode_tokens += 5
    assert scraped(first)["mlxgate_engine_decode_tokens_total"] == 5
    assert scraped(second)["mlxgate_engine_decode_tokens_total"] == 0
