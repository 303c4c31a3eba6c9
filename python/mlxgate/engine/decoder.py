"""The running sequences and the step that decodes them.

A decode step feeds each running row its last token and samples its next, in one forward pass
over the decode batch (engine/batch.py). Where the step's plan carries guesses
(engine/speculation.py), it is a verify pass instead: each row feeds its guesses after its
input token and keeps those the model confirms. Rank 0 samples and tells the router, which
decides when each stream ends; the other ranks are told the tokens.

A sequence that finishes leaves its prompt and reply in the prefix cache: the conversation's
next turn starts with them. One preempted for the KV memory budget leaves its keys/values there
too, and waits to resume from them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from mlxgate._native import FinishReason, Router
from mlxgate.engine.batch import FREE, DecodeBatch
from mlxgate.engine.batch_sampler import BatchSampler
from mlxgate.engine.cache_kinds import CacheLayout
from mlxgate.engine.constraints import Vocabulary
from mlxgate.engine.kv_memory import KVMemory
from mlxgate.engine.lockstep import Lockstep
from mlxgate.engine.metrics import EngineMetrics
from mlxgate.engine.prefill import Pending
from mlxgate.engine.prefix_cache import PrefixCache
from mlxgate.engine.sampling import Sampler
from mlxgate.engine.scheduler import Scheduler
from mlxgate.engine.speculation import Drafts, Speculation
from mlxgate.models import recurrent_guesses
from mlxgate.models.adapter import ModelAdapter
from mlxgate.models.rope_switch import ScaledRows

log = logging.getLogger("mlxgate.engine")

# A step's result: the tokens sampled [slots, width], the guesses each row kept, the streams
# that finished and those whose clients left.
StepResult = tuple[np.ndarray, np.ndarray, list[int], list[int]]


@dataclasses.dataclass(eq=False)
class Row:
    """A sequence in the decode batch."""

    pending: Pending  # as it was admitted (or resumed)
    sampler: Sampler
    tokens: list[int]  # its prompt and the tokens decoded since: its caches hold all but the last


class Decoder:
    """The decode batch, its rows by stream id, and the batch's sampler. Engine thread only."""

    def __init__(
        self,
        adapter: ModelAdapter,
        layout: CacheLayout,
        prefix_cache: PrefixCache,
        metrics: EngineMetrics,
        *,
        banded: bool,
        vocabulary: Vocabulary | None,
        speculation: Speculation | None,
        lockstep: Lockstep,
    ) -> None:
        self.adapter = adapter
        self.layout = layout
        self.prefix_cache = prefix_cache
        self.metrics = metrics
        self.banded = banded
        self.vocabulary = vocabulary
        self.speculation = speculation
        self.lockstep = lockstep
        self.rows: dict[int, Row] = {}
        self.reset()

    def reset(self) -> None:
        """An empty batch (MLX streams are per thread: made on the thread that will use it)."""
        self.batch = DecodeBatch(self.layout, self.banded)
        self.sampler = BatchSampler()  # the batch's: made and dropped with it
        self.rows = {}
        if self.speculation is not None:
            self.speculation.reset()

    def __len__(self) -> int:
        return len(self.batch)

    def step(self, drafts: Drafts | None, router: Router) -> list[int]:
        """One token per running row, or more for rows whose `drafts` the step confirms: one pass,
        then rank 0 samples and tells the `router`, and every rank learns the tokens and which
        streams ended. Returns the streams whose clients left (dropped as the next step starts)."""
        batch = self.batch
        slot_ids = batch.stream_ids
        scaled, deltas = self._scaled_rows(), self._rope_deltas()
        sample: Callable[[], tuple[np.ndarray, np.ndarray]]
        states: list[recurrent_guesses.LayerPass] = []
        if drafts is None:
            logits = self.adapter.decode(batch.inputs, batch.caches, scaled, deltas)
            sample = functools.partial(self._sample, logits)
        else:
            guesses = mx.array(drafts.tokens.astype(np.uint32))
            fed = mx.concatenate([batch.inputs[:, None], guesses], axis=1)
            batch.in_temporal_order()
            with recurrent_guesses.recording() as states:
                logits = self.adapter.verify(fed, batch.caches, scaled, deltas)
            sample = functools.partial(self._sample_positions, logits, drafts)
        took = functools.partial(self._took, slot_ids, drafts, states)
        tokens, kept, finished, cancelled = self.lockstep.share(
            lambda: self._emit(router, slot_ids, drafts, *took(*sample())),
            _encode_step,
            _decode_step,
            evaluated=logits,
        )
        if not self.lockstep.leader:
            took(tokens, kept)
        stream_ids, token_ids = _emitted(slot_ids, tokens, kept)
        self.metrics.decode_tokens += len(token_ids)
        rows = self.rows
        for stream_id, token in zip(stream_ids.tolist(), token_ids.tolist(), strict=True):
            rows[stream_id].tokens.append(token)
        if finished:
            self.metrics.requests_finished += len(finished)
            self._keep_replies(finished)
            batch.drop(np.isin(batch.stream_ids, finished))
        return cancelled

    def join(self, joining: list[Pending], caches: list[Any]) -> None:
        """Prefilled sequences join the batch: `caches`, per layer, a batch cache of their
        prompts."""
        now = time.monotonic()
        with self.metrics.lock:
            self.metrics.ttft_s.extend(now - p.submitted_at for p in joining if p.sampler is None)
        if self.speculation is not None:
            for p in joining:
                self.speculation.start(p.stream_id, p.request)
        samplers = [
            p.sampler or Sampler(p.request.sampling, p.request.grammar, p.request.prompt_ids)
            for p in joining
        ]
        for p, sampler in zip(joining, samplers, strict=True):
            self.rows[p.stream_id] = Row(p, sampler, list(p.request.prompt_ids))
        self.batch.add(
            caches,
            [len(p.request.prompt_ids) - 1 for p in joining],
            [p.stream_id for p in joining],
            samplers,
            [p.request.prompt_ids[-1] for p in joining],
            [p.scaled for p in joining],
        )

    def drop(self, stream_ids: list[int] | set[int]) -> int:
        """End the rows of `stream_ids` that run; returns how many did."""
        if not stream_ids:
            return 0
        ended = np.isin(self.batch.stream_ids, list(stream_ids))
        self.batch.drop(ended)
        return int(ended.sum())

    def tidy(self) -> None:
        """Forget the rows that left the batch."""
        if len(self.rows) > len(self.batch):
            self.rows = {sid: self.rows[sid] for sid in self.batch.running_ids if sid in self.rows}

    def keep_budget(self, memory: KVMemory, held_elsewhere: int, width: int) -> list[Pending]:
        """Preempt sequences, the youngest first (`Scheduler.preemption_order`), while the
        batch's caches and their growth in a step of `width` positions, with `held_elsewhere`
        bytes (the prompts in prefill), would outgrow the KV memory budget; returns them."""
        batch, rows = self.batch, self.rows
        running = ((sid, rows[sid].pending.submitted_at) for sid in batch.running_ids)
        preempted: list[Pending] = []
        for stream_id in Scheduler.preemption_order(running):
            held = batch.kv_bytes() + batch.growth_bytes(width, memory.token_bytes)
            if held + held_elsewhere <= memory.budget:
                break
            preempted.append(self.preempt(stream_id))
        return preempted

    def preempt(self, stream_id: int) -> Pending:
        """Take a sequence out of the batch to free its caches: its keys/values go into the prefix
        cache; returns it as a sequence to prefill again, with its own sampler, which resumes from
        them."""
        row = self.rows.pop(stream_id)
        pending = row.pending
        self.prefix_cache.store(
            pending.request.cache_keys(row.tokens[:-1]),
            self.batch.extract(stream_id),
            variant=int(pending.scaled),
        )
        self.batch.drop(self.batch.stream_ids == stream_id, compact=True)
        decoded = len(row.tokens) - len(pending.request.prompt_ids)
        max_tokens = pending.request.max_tokens
        request = dataclasses.replace(
            pending.request,
            prompt_ids=row.tokens,
            max_tokens=None if max_tokens is None else max(1, max_tokens - decoded),
            choices=1,
        )
        self.metrics.preemptions += 1
        log.info(
            "stream %d preempted after %d tokens to keep the KV memory budget", stream_id, decoded
        )
        return Pending(
            stream_id,
            request,
            None,
            pending.scaled,
            submitted_at=pending.submitted_at,
            sampler=row.sampler,
        )

    def _took(
        self,
        slot_ids: np.ndarray,
        drafts: Drafts | None,
        states: list[recurrent_guesses.LayerPass],
        tokens: np.ndarray,
        kept: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """What a step's tokens change (`kept`: the guesses each row keeps; `states`: a verify
        pass's record of its recurrent layers): the caches, the samplers, the next inputs, the
        guessing state. (On rank 0 before the router hears of them: a stream it ends has its
        step counted.)"""
        batch, speculation = self.batch, self.speculation
        if drafts is not None:
            self.sampler.keep(kept)
            batch.rewind(kept, drafts.width, states)  # the caches keep the kept guesses only
        self.sampler.seen(batch.samplers, tokens, kept)
        inputs = mx.array(tokens[np.arange(len(tokens)), kept])  # each row's last token
        # Free slots were computed too: their tokens go nowhere.
        self.sampler.advance(inputs)
        batch.advance(inputs)
        if speculation is not None:
            self._guessed(speculation, slot_ids, drafts, kept, tokens)
        return tokens, kept

    def _sample(self, logits: mx.array) -> tuple[np.ndarray, np.ndarray]:
        """Each row's next token [slots, 1] (and no guesses kept)."""
        inputs = self.sampler.sample(logits, self.batch.samplers, self.vocabulary)
        mx.eval(inputs)
        tokens = np.array(inputs)[:, None]
        return tokens, np.zeros(len(tokens), dtype=np.int64)

    def _sample_positions(self, logits: mx.array, drafts: Drafts) -> tuple[np.ndarray, np.ndarray]:
        """The tokens sampled at each position of a verify pass [slots, width], and how many
        guesses each row keeps."""
        tokens = self.sampler.sample_positions(
            logits, drafts.tokens, drafts.counts, self.batch.samplers, self.vocabulary
        )
        return tokens, drafts.kept(tokens)

    def _emit(
        self,
        router: Router,
        slot_ids: np.ndarray,
        drafts: Drafts | None,
        tokens: np.ndarray,
        kept: np.ndarray,
    ) -> StepResult:
        """The step's tokens to the router (their log-probabilities, and the guesses each stream
        kept, first); with them, the streams it finished and those whose clients left."""
        if sampled := self.sampler.logprobs(slot_ids):
            router.logprobs(sampled)
        if drafts is not None and self.speculation is not None:
            guessed = drafts.counts > 0
            router.guessed(
                slot_ids[guessed].tolist(),
                drafts.counts[guessed].tolist(),
                kept[guessed].tolist(),
                self.speculation.drafter,
            )
        # Each row's emitted tokens in order: the router ends a stream at the first that ends it.
        stream_ids, token_ids = _emitted(slot_ids, tokens, kept)
        ended = router.step(stream_ids, token_ids)
        finished = [sid for sid, why in ended if why != FinishReason.CANCELLED]
        if looped := [sid for sid, why in ended if why == FinishReason.REPETITION]:
            self.metrics.loop_stops += len(looped)
            for stream_id in looped:
                log.info("the loop guard ended stream %d: its reply repeats itself", stream_id)
        return tokens, kept, finished, [sid for sid, why in ended if why == FinishReason.CANCELLED]

    def _scaled_rows(self) -> ScaledRows:
        return self.batch.scaled if self.adapter.switched_rope else True

    def _rope_deltas(self) -> np.ndarray | None:
        """Per slot, how far its positions run behind its length (a vision model's M-RoPE: after
        an image; 0 for a free slot or a text-only row)."""
        if not self.adapter.per_row_positions:
            return None
        rows = self.rows
        return np.array(
            [rows[sid].pending.rope_delta if sid != FREE else 0 for sid in self.batch.stream_ids],
            dtype=np.int32,
        )

    def _guessed(
        self,
        speculation: Speculation,
        slot_ids: np.ndarray,
        drafts: Drafts | None,
        kept: np.ndarray,
        tokens: np.ndarray,
    ) -> None:
        drafted, accepted = speculation.emitted(slot_ids, drafts, kept, tokens)
        if drafts is not None:
            m = self.metrics
            m.verify_passes += 1
            m.drafted_tokens += drafted
            m.accepted_tokens += accepted
        speculation.forget(len(self.batch), lambda: self.batch.running_ids)

    def _keep_replies(self, finished: list[int]) -> None:
        """Finished sequences' prompts and replies go into the prefix cache: the conversation's
        next turn starts with them."""
        if self.prefix_cache.max_bytes <= 0:
            return
        for stream_id in finished:
            row = self.rows[stream_id]
            kept = row.tokens[:-1]  # the last token was sampled, never fed
            self.prefix_cache.store(
                row.pending.request.cache_keys(kept),
                self.batch.extract(stream_id),
                variant=int(row.pending.scaled),
            )
            self.metrics.reply_tokens_kept += len(kept) - len(row.pending.request.prompt_ids) + 1


def _encode_step(step: StepResult) -> list[Any]:
    tokens, kept, finished, cancelled = step
    return [tokens.tolist(), kept.tolist(), finished, cancelled]


def _decode_step(encoded: list[Any]) -> StepResult:
    tokens, kept, finished, cancelled = encoded
    return np.array(tokens, dtype=np.uint32), np.array(kept, dtype=np.int64), finished, cancelled


def _emitted(
    slot_ids: np.ndarray, tokens: np.ndarray, kept: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The (stream id, token id) pairs a step emits, each row's in order: its tokens up to
    and including the last kept (free slots' tokens go nowhere)."""
    emitted = (np.arange(tokens.shape[1]) <= kept[:, None]) & (slot_ids != FREE)[:, None]
    return np.broadcast_to(slot_ids[:, None], tokens.shape)[emitted], tokens[emitted]
