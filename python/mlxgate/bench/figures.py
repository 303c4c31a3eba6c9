"""The figures a run is summed up by: latency percentiles (TTFT, inter-token, end to end),
throughput per stream and in aggregate, goodput under a service-level objective, the cached
share of the prompts, failures by kind and the server's CPU time per output token."""

from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlxgate.bench.records import Record


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile, q in [0, 100]; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class Slo:
    """A reply meets it when it starts within `ttft_s` and then averages at most `itl_s` a
    token (goodput counts the tokens of the replies that meet it)."""

    ttft_s: float = 2.0
    itl_s: float = 0.25

    @classmethod
    def parse(cls, text: str) -> Slo:
        """`ttft=2s,itl=200ms` (either part may be left out)."""
        values: dict[str, float] = {}
        for part in filter(None, text.split(",")):
            match = re.fullmatch(r"(ttft|itl)=(\d+(?:\.\d+)?)(ms|s)", part.strip())
            if match is None:
                raise ValueError(f"an SLO part is ttft=... or itl=... in s or ms, not {part!r}")
            name, number, unit = match.groups()
            values[f"{name}_s"] = float(number) / (1000 if unit == "ms" else 1)
        return cls(**values)

    def met_by(self, record: Record) -> bool:
        if not record.ok or record.ttft_s is None or record.ttft_s > self.ttft_s:
            return False
        gaps = record.gaps
        return not gaps or statistics.fmean(gaps) <= self.itl_s


def _spread(values: Sequence[float], *qs: float) -> dict[str, float | None]:
    return {f"p{q:g}": percentile(values, q) for q in qs}


def summarize(
    records: Sequence[Record], wall_s: float, slo: Slo, cpu_s: float | None = None
) -> dict[str, Any]:
    """A run's figures; `cpu_s` is the server's CPU time over the run, when its pid is known."""
    ok = [r for r in records if r.ok]
    gaps = [g for r in ok for g in r.gaps]
    output = sum(r.output_tokens or 0 for r in ok)
    prompt = sum(r.input_tokens or 0 for r in ok)
    per_stream = [
        (r.output_tokens - 1) / (r.delta_times[-1] - r.delta_times[0])
        for r in ok
        if r.output_tokens
        and r.output_tokens > 1
        and len(r.delta_times) > 1
        and r.delta_times[-1] > r.delta_times[0]
    ]
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "failures": dict(Counter(r.error_kind for r in records if not r.ok)),
        # What the first failure of each kind said, to tell a refusal from a crash.
        "failure_examples": {
            r.error_kind: (r.error or "")[:200] for r in reversed(records) if not r.ok
        },
        "wall_s": wall_s,
        "output_tokens": output,
        # The server's own count: a server that cuts a prompt to its slot shows it here.
        "prompt_tokens_p50": percentile([r.input_tokens for r in ok if r.input_tokens], 50),
        "tokens_counted_by": "the server's usage",
        "output_tok_s": output / wall_s if wall_s > 0 else 0.0,
        "stream_tok_s_p50": percentile(per_stream, 50),
        "goodput_tok_s": sum(r.output_tokens or 0 for r in ok if slo.met_by(r)) / wall_s
        if wall_s > 0
        else 0.0,
        "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s},
        "ttft_s": _spread([r.ttft_s for r in ok if r.ttft_s is not None], 50, 95, 99),
        "itl_s": {**_spread(gaps, 50, 95, 99), "max": max(gaps) if gaps else None},
        "e2e_s": _spread([r.ended_at - r.sent_at for r in ok], 50, 95, 99),
        # None when the server does not say (llama-server's usage has no cached count).
        "cached_share": sum(r.cached_tokens or 0 for r in ok) / prompt
        if prompt and any(r.cached_tokens is not None for r in ok)
        else None,
        "cpu_s_per_output_token": cpu_s / output if cpu_s is not None and output else None,
    }
