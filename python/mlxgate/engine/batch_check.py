"""Whether mlx-lm's code for a model computes a batch as it computes each sequence alone.

Some does not: gemma2 broadcasts a batch mask over the wrong axis (an error at most batch sizes,
silently other numbers when the batch is as large as its key/value head count), nemotron_h lets
right padding into its recurrent state. The engine asks once, at start-up, with a few tokens,
and prefills or decodes such a model one sequence at a time rather than serve other text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx

from mlxgate.engine import cache_kinds
from mlxgate.engine.batch import DecodeBatch
from mlxgate.engine.cache_kinds import CacheLayout
from mlxgate.engine.contract import SamplingParams
from mlxgate.engine.sampling import Sampler
from mlxgate.models.adapter import ModelAdapter
from mlxgate.models.cpu import int8

log = logging.getLogger("mlxgate.engine")

# Prompts of different lengths; three of them, so that the batch is not as large as the two
# key/value heads of the smallest models (where a wrong mask broadcasts without an error).
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]
# Relative difference of logits beyond which batched and alone are not the same computation
# (rounding of the different matmul shapes is ~1e-6 in float32).
TOLERANCE = 1e-2


@dataclass(frozen=True)
class BatchProblems:
    prefill: str | None  # why prompts cannot prefill in one right-padded pass, if they cannot
    decode: str | None  # why sequences cannot decode in one batch, if they cannot


def checked(adapter: ModelAdapter, layout: CacheLayout, banded: bool) -> BatchProblems:
    """`check`, each problem found logged with what the engine does about it."""
    problems = check(adapter, layout, banded)
    if problems.prefill is not None:
        log.warning(
            "this model cannot prefill several prompts in one pass (%s): one at a time",
            problems.prefill,
        )
    if problems.decode is not None:
        log.warning(
            "this model cannot decode several sequences in one batch (%s): one at a time",
            problems.decode,
        )
    return problems


def check(adapter: ModelAdapter, layout: CacheLayout, banded: bool) -> BatchProblems:
    """(With --int8-activations, of the exact computation: that path differs by design between
    one row and several.)"""
    with int8.suspended(adapter.model):
        alone = _alone(adapter)
        return BatchProblems(_prefill(adapter, alone), _decode(adapter, layout, banded, alone))


def _prefill(adapter: ModelAdapter, alone: list[mx.array]) -> str | None:
    """The prompts but their last tokens prefilled right-padded in one pass, as the engine
    prefills short prompts together, then the last tokens decoded: checked by that step."""
    rests = [len(p) - 1 for p in PROMPTS]
    width = max(rests)
    caches = [cache_kinds.merge([c] * len(PROMPTS)) for c in adapter.make_cache()]
    tokens = mx.array([p[:-1] + [0] * (width - len(p) + 1) for p in PROMPTS], dtype=mx.uint32)
    try:
        for cache in caches:
            cache.prepare(lengths=rests, right_padding=[width - n for n in rests])
        adapter.prefill(tokens, caches)
        for cache in caches:
            cache.finalize()
        logits = adapter.decode(mx.array([p[-1] for p in PROMPTS], dtype=mx.uint32), caches)
    except Exception as exc:  # any failure means: do not batch this way
        return f"{type(exc).__name__}: {exc}"
    return _differs(list(logits), alone)


def _decode(
    adapter: ModelAdapter, layout: CacheLayout, banded: bool, alone: list[mx.array]
) -> str | None:
    """Each prompt prefilled alone and joined to one decode batch, as the engine does."""
    batch = DecodeBatch(layout, banded)
    greedy = Sampler(SamplingParams())
    try:
        for stream_id, prompt in enumerate(PROMPTS, start=1):
            caches = adapter.make_cache()
            adapter.prefill(mx.array([prompt[:-1]], dtype=mx.uint32), caches)
            rows = [cache_kinds.batch_of_one(c) for c in caches]
            batch.add(rows, [len(prompt) - 1], [stream_id], [greedy], [prompt[-1]])
        logits = adapter.decode(batch.inputs, batch.caches)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return _differs(list(logits), alone)


def _alone(adapter: ModelAdapter) -> list[mx.array]:
    """Each prompt's last logits, computed alone."""
    return [
        adapter.verify(mx.array([p], dtype=mx.uint32), adapter.make_cache())[0, -1] for p in PROMPTS
    ]


def _differs(batched: list[mx.array], alone: list[mx.array]) -> str | None:
    """How batched logits differ from logits computed alone, beyond rounding; None if not."""
    for row, (a, b) in enumerate(zip(batched, alone, strict=True)):
        a32, b32 = a.astype(mx.float32), b.astype(mx.float32)
        ratio = mx.linalg.norm(a32 - b32) / mx.maximum(mx.linalg.norm(b32), 1e-6)
        error: float = ratio.item()  # type: ignore[assignment]
        if error > TOLERANCE:
            return f"row {row}'s logits differ from its logits alone by {error:.0%}"
    return None
