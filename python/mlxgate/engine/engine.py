"""The engine: admission, and the thread that owns the model and runs its steps.

The engine thread is the only thread that touches MLX. Every step decodes one token for each
running sequence, then spends the step's prefill budget (engine/policy.py) on waiting prompts
(engine/prefill.py), so a long prompt never stalls running streams for more than a budget's
worth of compute.

While few sequences decode, a decode step may be a verify pass instead: rows that guess their
next tokens from their own prompt and output (engine/speculation.py) feed them after their input
token, and keep those the model confirms.

A sequence that finishes leaves its prompt and reply in the prefix cache: the conversation's
next turn starts with them. The KV caches the engine holds stay within a memory budget
(engine/kv_memory.py): when the batch's would outgrow it, the youngest sequence is preempted
(its keys/values kept in the prefix cache) and resumes from there, exactly, once there is room.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxgate._native import ErrorKind, FinishReason, Reader, Router, StreamSpec
from mlxgate.engine import batch_check, disk_cache, heap
from mlxgate.engine.batch import FREE, DecodeBatch
from mlxgate.engine.batch_sampler import BatchSampler
from mlxgate.engine.cache_kinds import CacheLayout
from mlxgate.engine.constraints import Vocabulary
from mlxgate.engine.contract import EngineStopped, GenerationRequest, PromptTooLong, QueueFull
from mlxgate.engine.kv_memory import KVMemory, default_budget
from mlxgate.engine.lockstep import Lockstep, RanksDiverged
from mlxgate.engine.metrics import EngineMetrics
from mlxgate.engine.policy import StepPolicy
from mlxgate.engine.prefill import Pending, Prefill, StepPrefill
from mlxgate.engine.prefix_cache import PrefixCache, entry_bytes
from mlxgate.engine.sampling import Sampler
from mlxgate.engine.settings import EngineSettings
from mlxgate.engine.speculation import Drafts, Speculation
from mlxgate.engine.vision_jobs import VisionJobs
from mlxgate.models import LoadedModel
from mlxgate.models.adapter import ModelAdapter
from mlxgate.models.rope_switch import ScaledRows

log = logging.getLogger("mlxgate.engine")

# How often an engine with nothing to do but wait for vision towers looks for cancels.
VISION_POLL_S = 0.05
# Across ranks, the times a prefill pass checks for cancels (each check a collective; one
# process checks after every layer).
STOP_CHECKS_ACROSS_RANKS = 4


@dataclasses.dataclass(eq=False)
class _Row:
    """A sequence in the decode batch."""

    pending: Pending  # as it was admitted (or resumed)
    sampler: Sampler
    tokens: list[int]  # its prompt and the tokens decoded since: its caches hold all but the last


@dataclasses.dataclass
class _Intake:
    """What happens between two steps (`Engine._intake`)."""

    running: bool  # False once the engine stops
    taken: list[Pending]  # admitted since
    cancelled: list[int]  # streams whose clients left
    stalled: list[int]  # streams unread past the stall timeout (the router has ended them)
    state: list[int]  # rank 0's digest of its engine, to check the others' against
    preempted: list[int] = dataclasses.field(default_factory=list)

    def encode(self) -> list[Any]:
        taken = [_encoded_pending(pending) for pending in self.taken]
        return [self.running, taken, self.cancelled, self.stalled, self.state, self.preempted]

    @classmethod
    def decode(cls, encoded: list[Any]) -> _Intake:
        running, taken, cancelled, stalled, state, preempted = encoded
        return cls(
            running, [_decoded_pending(p) for p in taken], cancelled, stalled, state, preempted
        )


def _encoded_pending(pending: Pending) -> list[Any]:
    """What another rank needs of an admitted sequence (every choice of it)."""
    request = pending.request
    ids = [choice.stream_id for choice in pending.choices]
    return [ids, request.prompt_ids, request.max_tokens, pending.scaled, request.speculate]


def _decoded_pending(encoded: list[Any]) -> Pending:
    """Rank 0's admitted sequence on another rank: what its model calls need (no stream, no
    sampling: rank 0 samples)."""
    ids, prompt_ids, max_tokens, scaled, speculate = encoded
    request = GenerationRequest(
        prompt_ids, cast(StreamSpec, None), max_tokens, speculate=speculate, choices=len(ids)
    )
    lead, *siblings = [Pending(stream_id, request, None, scaled) for stream_id in ids]
    lead.siblings = siblings
    return lead


def _encode_drafts(drafts: Drafts | None) -> list[Any] | None:
    return None if drafts is None else [drafts.counts.tolist(), drafts.tokens.tolist()]


def _decode_drafts(encoded: list[Any] | None) -> Drafts | None:
    if encoded is None:
        return None
    return Drafts(np.array(encoded[0], dtype=np.int64), np.array(encoded[1], dtype=np.int64))


def _encode_step(step: tuple[np.ndarray, np.ndarray, list[int], list[int]]) -> list[Any]:
    tokens, kept, finished, cancelled = step
    return [tokens.tolist(), kept.tolist(), finished, cancelled]


def _decode_step(encoded: list[Any]) -> tuple[np.ndarray, np.ndarray, list[int], list[int]]:
    tokens, kept, finished, cancelled = encoded
    return np.array(tokens, dtype=np.uint32), np.array(kept, dtype=np.int64), finished, cancelled


def _emitted(
    slot_ids: np.ndarray, tokens: np.ndarray, kept: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The (stream id, token id) pairs a step emits, each row's in order: its tokens up to
    and including the last kept (free slots' tokens go nowhere)."""
    emitted = (np.arange(tokens.shape[1]) <= kept[:, None]) & (slot_ids != FREE)[:, None]
    return np.broadcast_to(slot_ids[:, None], tokens.shape)[emitted], tokens[emitted]


def _choice(request: GenerationRequest, index: int) -> GenerationRequest:
    """Choice `index` of the request: with a seed, its own seed."""
    seed = request.sampling.seed
    if index == 0 or seed is None:
        return request
    return dataclasses.replace(
        request, sampling=dataclasses.replace(request.sampling, seed=seed + index)
    )


class Engine:
    """Owns the model on one thread; implements `GenerationEngine`. `admit` returns a stream
    reader at once and never blocks. The router decides when each stream ends; the engine drops
    the rows it reports."""

    def __init__(
        self,
        loaded: LoadedModel,
        router: Router,
        settings: EngineSettings | None = None,
        end_ids: list[int] | None = None,
        draft_model: nn.Module | None = None,
        turn: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
        vision_turn: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
        lockstep: Lockstep | None = None,
    ) -> None:
        """`end_ids`: the tokens that end a reply (the tokenizer's end-of-sequence ids unless
        given): where a grammar lets a constrained reply end. `draft_model`: a smaller model
        with the same tokenizer that guesses tokens ahead (else prompt lookup guesses).
        `turn`: entered for each step, where several engines share the machine (one computes
        at a time); `vision_turn`: entered for each part of a vision model's tower
        (engine/vision_jobs.py). `lockstep`: this engine's rank where the model is sharded over
        several (engine/lockstep.py): rank 0 decides, the others follow."""
        self.loaded = loaded
        self.lockstep = lockstep or Lockstep()
        self._turn = turn
        self.model = loaded.model
        self.router = router
        self.settings = settings or EngineSettings()
        self.metrics = EngineMetrics()
        kv_bits = self.settings.kv_bits
        vision = None  # where a vision model's prompts have their images encoded
        if loaded.vision is not None:
            from mlxgate.models.vision import VisionAdapter

            tower = VisionAdapter(self.model, kv_bits, self.settings.kv_group_size)
            vision = VisionJobs(tower, self._notify, vision_turn)
            self._adapter: ModelAdapter = tower
        else:
            self._adapter = ModelAdapter(self.model, kv_bits, self.settings.kv_group_size)
        if kv_bits:
            log.info("quantized KV cache: %s", self._adapter.check_quantized_kv())
        if self.lockstep.ranks > 1:
            self._adapter.stop_every = max(1, len(self._adapter.layers) // STOP_CHECKS_ACROSS_RANKS)
        # An engine around a bare model (tests, benchmarks) has no tokenizer, and no grammars.
        tokenizer = loaded.tokenizer
        self.vocabulary = (
            Vocabulary(tokenizer.tokenizer, end_ids or sorted(tokenizer.eos_ids))
            if tokenizer is not None
            else None
        )
        # Raises UnsupportedCache for a layer cache the engine cannot batch: at start-up.
        self.layout = CacheLayout.of(self._adapter.make_cache())
        self.disk_cache = disk_cache.configured(
            self.settings.prefix_cache_dir,
            self.settings.prefix_cache_disk_gb,
            loaded,
            self._adapter.make_cache,
            self.layout.cuttable,
        )
        self.prefix_cache = PrefixCache(
            self.settings.prefix_cache_mb << 20,
            cuttable=self.layout.cuttable,
            measure=self._measure,
            disk=self.disk_cache,
        )
        self.kv_memory = self._kv_memory()
        self.metrics.kv_budget_bytes = self.kv_memory.budget
        # Bands of rows need the attention that attends band by band.
        self._banded = self._adapter.banded_attention
        # mlx-lm's code for some models gets batches wrong: found out now, not by a client.
        self.batch_problems = batch_check.check(self._adapter, self.layout, self._banded)
        if self.batch_problems.prefill is not None:
            log.warning(
                "this model cannot prefill several prompts in one pass (%s): one at a time",
                self.batch_problems.prefill,
            )
        if self.batch_problems.decode is not None:
            log.warning(
                "this model cannot decode several sequences in one batch (%s): one at a time",
                self.batch_problems.decode,
            )
            self.settings = dataclasses.replace(self.settings, max_running=1)
        # Guessing tokens ahead (engine/speculation.py); None where it is off.
        self.speculation = Speculation.configured(
            self.settings, self.layout, loaded.context_length, draft_model
        )
        self._gone: set[int] = set()  # cancelled stream ids not yet dropped
        self._ids = itertools.count(1)
        self._incoming: deque[Pending] = deque()
        self._wakeup = threading.Condition()
        self._running = threading.Event()
        self._thread: threading.Thread | None = None
        # Engine-thread state.
        self.policy = StepPolicy(self.settings)
        self.prefill = Prefill(
            self._adapter,
            self.layout,
            self.prefix_cache,
            self.policy,
            self.metrics,
            grouped=self.batch_problems.prefill is None,
            cancelled=self._poll_cancelled,
            # Looked up at each call: a router swapped in later (tests wrap it) is the one used.
            ping=lambda stream_id: self.router.ping(stream_id),
            join=self._add_rows,
            cached=lambda stream_id, tokens, tier: self.router.cached(stream_id, tokens, tier),
            memory=self.kv_memory,
            vision=vision,
            lockstep=self.lockstep,
        )
        self._rows: dict[int, _Row] = {}  # by stream id
        self._batch = DecodeBatch(self.layout, self._banded)
        self._sampler = BatchSampler()  # the batch's: made and dropped with it
        self._trim_heap = heap.trimmer()
        self._heap_trimmed_at = 0.0

    def admit(self, request: GenerationRequest) -> Reader:
        """Open the request's response and queue it, or raise an AdmissionError. The choices of
        OpenAI's `n` are one sequence, prefilled once; each then decodes on its own copy of the
        cache, into the one response."""
        if not self._running.is_set():
            raise EngineStopped()
        prompt_ids = request.prompt_ids
        prompt_tokens = len(prompt_ids)
        context = self.loaded.context_length
        if prompt_tokens >= context:  # at least one token must fit after the prompt
            raise PromptTooLong(prompt_tokens, context)
        if self.kv_memory.need(prompt_tokens + 1) > self.kv_memory.budget:
            raise PromptTooLong(prompt_tokens, self.kv_memory.most_tokens() - 1, memory=True)
        queued = len(self._incoming) + self.metrics.queue_depth
        if queued >= self.settings.max_queued:
            raise QueueFull(retry_after_s=1 + queued // 8)
        served = self.loaded.context
        window = served.window(prompt_tokens, request.max_tokens) if served else context
        scaled = window > (served.native if served else context)
        # One lookup for every choice: a match is immutable, and each start copies its caches.
        # (With ranks, every rank looks up as the engine takes the request in: `_intake`.)
        match = (
            self.prefix_cache.lookup(request.cache_keys(), variant=int(scaled))
            if self.lockstep.ranks == 1
            else None
        )
        cached = match.length if match else 0
        choices = [
            Pending(next(self._ids), _choice(request, index), match, scaled, reported=cached)
            for index in range(request.choices)
        ]
        # Choices decode together; where they cannot (more than may run at once), each is a
        # sequence of its own, the prefix cache sharing what it can.
        together = len(choices) <= self.settings.max_running
        # Opened and queued as one: a cancel the engine polls finds the request somewhere.
        with self._wakeup:
            reader = self.router.open(
                [pending.stream_id for pending in choices],
                request.stream,
                prompt_tokens=prompt_tokens,
                cached_tokens=cached,
                cached_from=match.tier if match is not None else "",
                max_tokens=min(request.max_tokens or window, window - prompt_tokens),
                loop_span=self.settings.loop_guard_tokens if request.loop_guard else 0,
            )
            if together:
                choices[0].siblings = choices[1:]
                self._incoming.append(choices[0])
            else:
                self._incoming.extend(choices)
            self._wakeup.notify()
        return reader

    def busy(self) -> bool:
        return len(self.router) > 0

    def _kv_memory(self) -> KVMemory:
        """What a sequence's caches cost (measured on a one-token prefill), and the budget
        (rank 0's, on every rank)."""
        caches = self._adapter.make_cache()
        self._adapter.prefill(mx.array([[0]], dtype=mx.uint32), caches)
        s = self.settings
        if s.kv_memory_gb > 0:
            budget = int(s.kv_memory_gb * 2**30)
        else:
            budget = default_budget(mx.get_active_memory(), s.prefix_cache_mb << 20)
        own = KVMemory.of(caches, budget)
        memory = self.lockstep.share(lambda: own, dataclasses.astuple, lambda v: KVMemory(*v))
        # Shards of the same size (tensor parallel) store entries of the same size: each rank
        # measures its own. Otherwise (pipeline parallel: runs of layers) rank 0's sizes count.
        own_sizes = (own.token_bytes, own.fixed_bytes)
        self._shared_sizes = self.lockstep.any(
            (memory.token_bytes, memory.fixed_bytes) != own_sizes
        )
        return memory

    def _measure(self, caches: list[Any]) -> int:
        """A prefix cache entry's bytes: the same on every rank (so their evictions agree)."""
        if not self._shared_sizes:
            return entry_bytes(caches)
        return self.lockstep.share(lambda: entry_bytes(caches))

    def start(self) -> None:
        self._running.set()
        self._thread = threading.Thread(target=self._run, name="mlxgate-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._running.clear()
        if self.prefill.vision is not None:
            self.prefill.vision.stop()
        self._notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self.prefix_cache.close()
        self._fail_streams(ErrorKind.UNAVAILABLE, "the server is shutting down")

    def wait(self) -> None:
        """Until the engine's thread ends (another rank's engine: when rank 0's stops)."""
        if self._thread is not None:
            self._thread.join()

    def abandon(self, message: str) -> None:
        """End every stream with `message` and admit no more, from any thread: the group of
        ranks this engine leads has failed (ranks.py), and its thread may never return."""
        self._running.clear()
        self._fail_streams(ErrorKind.INTERNAL, message)

    def _fail_streams(self, kind: ErrorKind, message: str) -> None:
        held = [c.stream_id for p in (*self._incoming, *self.prefill.waiting) for c in p.choices]
        for stream_id in dict.fromkeys([*held, *self._batch.running_ids]):
            self.router.fail(stream_id, kind, message)

    # --- engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        # MLX streams are per thread: every array the engine evaluates is made on this thread.
        self._batch, self._sampler = DecodeBatch(self.layout, self._banded), BatchSampler()
        if self.speculation is not None:
            self.speculation.reset()
        leader = self.lockstep.leader
        while True:
            if leader:
                with self._wakeup:
                    if not self._has_work():
                        self._wakeup.wait(timeout=1.0)
                    elif self._waits_for_vision():
                        self._wakeup.wait(timeout=VISION_POLL_S)
            worked = False
            try:
                if not self._intake():
                    break
                worked = self._has_work()
                with self._turn():
                    self._step()
            except Exception as exc:
                log.exception("engine step failed; failing the affected streams")
                self._fail_all(f"generation failed: {exc}")
                if self.lockstep.ranks > 1:  # the other ranks are somewhere else in the step
                    self.lockstep.failed(f"the engine step failed: {exc}")
                    return
            if worked:
                self._tidy_heap()
        self.lockstep.stopped = True

    def _has_work(self) -> bool:
        return bool(self._incoming or self.prefill.waiting or len(self._batch))

    def _waits_for_vision(self) -> bool:
        """Whether every prompt waits for its images' vision tower, and nothing decodes: the
        engine sleeps until a job finishes, stepping every VISION_POLL_S all the same (for
        cancels, which stop the tower, and keep-alives)."""
        return not (self._incoming or len(self._batch)) and self.prefill.blocked_on_vision()

    def _notify(self) -> None:
        with self._wakeup:
            self._wakeup.notify()

    def _tidy_heap(self) -> None:
        """After a step that worked: give the heap's free pages back every few seconds of work,
        and once more on going idle (engine/heap.py)."""
        now = time.monotonic()
        if self._trim_heap is None or (
            self._has_work() and now - self._heap_trimmed_at < heap.TRIM_INTERVAL_S
        ):
            return
        self._trim_heap()
        self._heap_trimmed_at = time.monotonic()
        with self.metrics.lock:
            self.metrics.heap_trims += 1
            self.metrics.heap_trim_s += self._heap_trimmed_at - now

    def _fail_all(self, message: str) -> None:
        held = self.prefill.clear()
        for stream_id in dict.fromkeys([*self._batch.running_ids, *held]):
            self.router.fail(stream_id, ErrorKind.INTERNAL, message)
        self._batch, self._sampler = DecodeBatch(self.layout, self._banded), BatchSampler()
        self._rows = {}
        if self.speculation is not None:
            self.speculation.reset()

    def _step(self) -> None:
        self._update_gauges()
        prefill, policy = self.prefill, self.policy
        if not (prefill.waiting or len(self._batch)):
            return
        started = time.perf_counter()
        decoding = len(self._batch)
        if decoding:
            self._decode()
            policy.decoded(time.perf_counter() - started)
        if prefill.waiting:
            prefill_started = time.perf_counter()
            prefilled = prefill.run(lambda: self._prefill_budget(decoding), len(self._batch))
            policy.prefilled(prefilled, time.perf_counter() - prefill_started)
        prefill.ping()
        if len(self._rows) > len(self._batch):
            running = self._batch.running_ids
            self._rows = {sid: self._rows[sid] for sid in running if sid in self._rows}
        elapsed = time.perf_counter() - started
        m = self.metrics
        with m.lock:
            m.steps += 1
            m.last_step_s = elapsed
            m.busy_s += elapsed
            if decoding:
                m.step_s.append(elapsed)
        self._update_gauges()
        m.kv_bytes = self._batch.kv_bytes() + prefill.held_bytes()  # once a step: not cheap

    def _prefill_budget(self, decoding: int) -> StepPrefill:
        """This step's prefill: its token budget, its time allowance, the KV memory it may take."""
        policy, prefill = self.policy, self.prefill
        allowance_s = policy.allowance_s(decoding, len(prefill.waiting))
        budget = policy.budget(decoding, allowance_s)
        # Rows that finished in this step's decode have left: their room is free.
        kv_room = self.kv_memory.budget - self._batch.kv_bytes() - prefill.held_bytes()
        return budget, allowance_s, kv_room

    def _drop_stalled(self, stalled: list[int]) -> None:
        """The engine never waits for a reader: a stream unread past the stall timeout is ended
        (by the router, which names them)."""
        for stream_id in stalled:
            log.warning("stream %d: client stopped reading; cancelling its generation", stream_id)
        if stalled:
            ended = np.isin(self._batch.stream_ids, stalled)
            self.metrics.requests_cancelled += int(ended.sum())
            self._batch.drop(ended)

    def _update_gauges(self) -> None:
        self.metrics.queue_depth = len(self.prefill.waiting)
        self.metrics.running = len(self._batch)

    def _keep_budget(self) -> list[int]:
        """Preempt the youngest decoding sequences while the batch's caches, their growth in the
        next step and the prompts in prefill would outgrow the KV memory budget; returns their
        stream ids. The oldest always goes on (a prompt that cannot fit alone was refused at
        admission)."""
        memory, batch = self.kv_memory, self._batch
        width = 1 + (self.settings.max_draft_tokens if self.speculation is not None else 0)
        preempted: list[int] = []
        while len(batch) > 1:
            held = batch.kv_bytes() + batch.growth_bytes(width, memory.token_bytes)
            if held + self.prefill.held_bytes() <= memory.budget:
                break
            running = [self._rows[sid] for sid in batch.running_ids]
            youngest = max(running, key=lambda row: row.pending.submitted_at)
            self._preempt(youngest)
            preempted.append(youngest.pending.stream_id)
        return preempted

    def _preempt(self, row: _Row) -> None:
        """Take a sequence out of the batch to free its caches: its keys/values go into the prefix
        cache, and it waits again, with its own sampler, to resume from them."""
        pending = row.pending
        stream_id = pending.stream_id
        self.prefix_cache.store(
            pending.request.cache_keys(row.tokens[:-1]),
            self._batch.extract(stream_id),
            variant=int(pending.scaled),
        )
        self._batch.drop(self._batch.stream_ids == stream_id, compact=True)
        del self._rows[stream_id]
        decoded = len(row.tokens) - len(pending.request.prompt_ids)
        max_tokens = pending.request.max_tokens
        request = dataclasses.replace(
            pending.request,
            prompt_ids=row.tokens,
            max_tokens=None if max_tokens is None else max(1, max_tokens - decoded),
            choices=1,
        )
        self.prefill.waiting.append(
            Pending(
                stream_id,
                request,
                None,
                pending.scaled,
                submitted_at=pending.submitted_at,
                sampler=row.sampler,
            )
        )
        self.metrics.preemptions += 1
        log.info(
            "stream %d preempted after %d tokens to keep the KV memory budget", stream_id, decoded
        )

    def _poll_cancelled(self) -> set[int]:
        self._gone.update(self.lockstep.share(lambda: self.router.cancelled()))
        return self._gone

    def _intake(self) -> bool:
        """Between two steps: take the admitted requests in, drop the streams whose clients left
        or stopped reading, keep the KV memory budget; False once the engine stops. (With ranks,
        rank 0 decides and the others are told, in one share, with its state to check theirs.)"""
        state = self._digest() if self.lockstep.ranks > 1 else []
        intake = self.lockstep.share(
            lambda: self._decide_intake(state), _Intake.encode, _Intake.decode
        )
        if intake.state != state:
            raise RanksDiverged(
                f"rank {self.lockstep.rank}'s engine state {state} is not rank 0's "
                f"{intake.state}: the ranks no longer run the same schedule"
            )
        if not self.lockstep.leader:
            self._take(intake)
            for stream_id in intake.preempted:
                self._preempt(self._rows[stream_id])
        return intake.running

    def _decide_intake(self, state: list[int]) -> _Intake:
        intake = _Intake(
            self._running.is_set(),
            self._queued(),
            self.router.cancelled(),
            self.router.fail_stalled(self.settings.stall_timeout_s),
            state,
        )
        self._take(intake)
        intake.preempted = self._keep_budget()
        return intake

    def _take(self, intake: _Intake) -> None:
        for pending in intake.taken:
            if self.lockstep.ranks > 1:  # every rank looks up at the same point of the schedule
                pending.match = self.prefix_cache.lookup(
                    pending.request.cache_keys(), variant=int(pending.scaled)
                )
            self.prefill.waiting.append(pending)
        self._gone.update(intake.cancelled)
        self._drop_cancelled()
        self._drop_stalled(intake.stalled)

    def _queued(self) -> list[Pending]:
        with self._wakeup:
            taken = list(self._incoming)
            self._incoming.clear()
        return taken

    def _digest(self) -> list[int]:
        """What every rank's engine agrees on between steps."""
        batch, waiting = self._batch, self.prefill.waiting
        return [
            len(batch),
            int(batch.stream_ids.sum()),
            len(waiting),
            sum(p.done for p in waiting),
            len(self.prefix_cache),
            self.prefix_cache.nbytes,
        ]

    def _drop_cancelled(self) -> None:
        gone = self._gone
        if not gone:
            return
        self._gone = set()
        dropped = self.prefill.drop(gone)
        ended = np.isin(self._batch.stream_ids, list(gone))
        self._batch.drop(ended)
        self.metrics.requests_cancelled += dropped + int(ended.sum())

    def _decode(self) -> None:
        """One token per running row, or more for rows whose guesses the step confirms: one pass
        (a verify pass over the guesses), then rank 0 samples and tells the router, and every
        rank learns the tokens and which streams ended."""
        batch = self._batch
        speculation = self.speculation
        drafts = None
        if speculation is not None and len(batch) <= self.settings.speculation_max_rows:
            drafts = self.lockstep.share(
                lambda: speculation.drafts(batch.stream_ids), _encode_drafts, _decode_drafts
            )
        slot_ids = batch.stream_ids
        scaled, deltas = self._scaled_rows(), self._rope_deltas()
        sample: Callable[[], tuple[np.ndarray, np.ndarray]]
        if drafts is None:
            logits = self._adapter.decode(batch.inputs, batch.caches, scaled, deltas)
            sample = functools.partial(self._sample, logits)
        else:
            guesses = mx.array(drafts.tokens.astype(np.uint32))
            fed = mx.concatenate([batch.inputs[:, None], guesses], axis=1)
            logits = self._adapter.verify(fed, batch.caches, scaled, deltas)
            sample = functools.partial(self._sample_positions, logits, drafts)
        took = functools.partial(self._took, slot_ids, drafts)
        tokens, kept, finished, cancelled = self.lockstep.share(
            lambda: self._emit(slot_ids, *took(*sample())),
            _encode_step,
            _decode_step,
            evaluated=logits,
        )
        if not self.lockstep.leader:
            took(tokens, kept)
        stream_ids, token_ids = _emitted(slot_ids, tokens, kept)
        self.metrics.decode_tokens += len(token_ids)
        rows = self._rows
        for stream_id, token in zip(stream_ids.tolist(), token_ids.tolist(), strict=True):
            rows[stream_id].tokens.append(token)
        if finished:
            self.metrics.requests_finished += len(finished)
            self._keep_replies(finished)
            batch.drop(np.isin(batch.stream_ids, finished))
        self._gone.update(cancelled)  # dropped as the next step starts

    def _took(
        self, slot_ids: np.ndarray, drafts: Drafts | None, tokens: np.ndarray, kept: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """What a step's tokens change (`kept`: the guesses each row keeps): the caches, the
        samplers, the next inputs, the guessing state. (On rank 0 before the router hears of
        them: a stream it ends has its step counted.)"""
        batch, speculation = self._batch, self.speculation
        if drafts is not None:
            self._sampler.keep(kept)
            batch.rewind(kept, drafts.width)  # the caches keep the kept guesses only
        self._sampler.seen(batch.samplers, tokens, kept)
        inputs = mx.array(tokens[np.arange(len(tokens)), kept])  # each row's last token
        # Free slots were computed too: their tokens go nowhere.
        self._sampler.advance(inputs)
        batch.advance(inputs)
        if speculation is not None:
            self._guessed(speculation, slot_ids, drafts, kept, tokens)
        return tokens, kept

    def _sample(self, logits: mx.array) -> tuple[np.ndarray, np.ndarray]:
        """Each row's next token [slots, 1] (and no guesses kept)."""
        inputs = self._sampler.sample(logits, self._batch.samplers, self.vocabulary)
        mx.eval(inputs)
        tokens = np.array(inputs)[:, None]
        return tokens, np.zeros(len(tokens), dtype=np.int64)

    def _sample_positions(self, logits: mx.array, drafts: Drafts) -> tuple[np.ndarray, np.ndarray]:
        """The tokens sampled at each position of a verify pass [slots, width], and how many
        guesses each row keeps."""
        tokens = self._sampler.sample_positions(
            logits, drafts.tokens, drafts.counts, self._batch.samplers, self.vocabulary
        )
        return tokens, drafts.kept(tokens)

    def _emit(
        self, slot_ids: np.ndarray, tokens: np.ndarray, kept: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, list[int], list[int]]:
        """The step's tokens to the router (their log-probabilities first); with them, the
        streams it finished and those whose clients left."""
        if sampled := self._sampler.logprobs(slot_ids):
            self.router.logprobs(sampled)
        # Each row's emitted tokens in order: the router ends a stream at the first that ends it.
        stream_ids, token_ids = _emitted(slot_ids, tokens, kept)
        ended = self.router.step(stream_ids, token_ids)
        finished = [sid for sid, why in ended if why != FinishReason.CANCELLED]
        if looped := [sid for sid, why in ended if why == FinishReason.REPETITION]:
            self.metrics.loop_stops += len(looped)
            for stream_id in looped:
                log.info("the loop guard ended stream %d: its reply repeats itself", stream_id)
        return tokens, kept, finished, [sid for sid, why in ended if why == FinishReason.CANCELLED]

    def _scaled_rows(self) -> ScaledRows:
        return self._batch.scaled if self._adapter.switched_rope else True

    def _rope_deltas(self) -> np.ndarray | None:
        """Per slot, how far its positions run behind its length (a vision model's M-RoPE: after
        an image; 0 for a free slot or a text-only row)."""
        if not self._adapter.per_row_positions:
            return None
        rows = self._rows
        return np.array(
            [rows[sid].pending.rope_delta if sid != FREE else 0 for sid in self._batch.stream_ids],
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
        speculation.forget(len(self._batch), lambda: self._batch.running_ids)

    def _keep_replies(self, finished: list[int]) -> None:
        """Finished sequences' prompts and replies go into the prefix cache: the conversation's
        next turn starts with them."""
        if self.prefix_cache.max_bytes <= 0:
            return
        for stream_id in finished:
            row = self._rows[stream_id]
            kept = row.tokens[:-1]  # the last token was sampled, never fed
            self.prefix_cache.store(
                row.pending.request.cache_keys(kept),
                self._batch.extract(stream_id),
                variant=int(row.pending.scaled),
            )
            self.metrics.reply_tokens_kept += len(kept) - len(row.pending.request.prompt_ids) + 1

    def _add_rows(self, joining: list[Pending], caches: list[Any]) -> None:
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
            self._rows[p.stream_id] = _Row(p, sampler, list(p.request.prompt_ids))
        self._batch.add(
            caches,
            [len(p.request.prompt_ids) - 1 for p in joining],
            [p.stream_id for p in joining],
            samplers,
            [p.request.prompt_ids[-1] for p in joining],
            [p.scaled for p in joining],
        )
