"""Prompts from admission until they join the decode batch: the queue and the prefill passes.

A step prefills as its plan says (engine/scheduler.py): up to a budget, the prompt with the
least prefill left first (a prompt's wait counts for it too, so a long one still finishes): an
agent's short turn does not wait behind another session's long first turn. Several short
prompts that fit go through the model together, one row each of a batched KV cache; a long
prompt goes chunk by chunk, one chunk per step while streams decode. A prompt joins the running
batch once all but its last token is in the KV cache; that last token is its first decode input.

A prompt whose prefix another waiting prompt is computing right now waits for it instead of
computing it again, and starts from those keys/values once they are done (in-flight sharing).
With a KV memory budget, a prompt starts only when its cache fits (engine/kv_memory.py).

A pass stops between layers once every client it serves has left; such a prefill is torn: some
layers hold more tokens than it finished. What it finished goes to the prefix cache, and where
another choice of the same prompt goes on, its caches are cut back to that (mended).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from mlxgate.engine import cache_kinds
from mlxgate.engine.cache_kinds import CacheLayout
from mlxgate.engine.contract import GenerationRequest
from mlxgate.engine.kv_memory import KVMemory
from mlxgate.engine.metrics import EngineMetrics
from mlxgate.engine.prefix_cache import (
    CacheEntry,
    MemoryMatch,
    PrefixCache,
    PrefixMatch,
    common_prefix,
)
from mlxgate.engine.sampling import Sampler
from mlxgate.engine.scheduler import PrefillPlan, Scheduler, chunk_cost
from mlxgate.models.adapter import ModelAdapter
from mlxgate.models.rope_switch import ScaledRows

if TYPE_CHECKING:
    from mlxgate.engine.vision_jobs import VisionJob, VisionJobs
    from mlxgate.models.vision import Features


@dataclass(eq=False)
class Pending:
    """A sequence from admission until it joins the running batch."""

    stream_id: int
    request: GenerationRequest
    match: PrefixMatch | None
    scaled: bool = False  # served with the scaled rope (models/rope_switch.py)
    submitted_at: float = field(default_factory=time.monotonic)
    last_ping: float = field(default_factory=time.monotonic)
    caches: list[Any] | None = None  # per layer (`model.make_cache()`), once prefill started
    done: int = 0  # prompt tokens whose keys/values are in `caches`
    # (tokens, seconds) of its latest prefill pass, averaged with those before (`chunk_cost`)
    last_chunk: tuple[int, float] | None = None
    torn: bool = False  # a pass stopped part way: `caches` hold more than `done` in some layers
    # A sequence preempted while decoding (its prompt: the prompt and the tokens it decoded):
    # its sampler goes on where it was.
    sampler: Sampler | None = None
    held: bool = False  # has waited for another prompt's prefill of its prefix
    reported: int = 0  # the cached tokens its response was opened with
    looked_at: int = 0  # the prefix cache's `stores` when it was last looked up
    shared: dict[int, int] = field(default_factory=dict)  # stream id -> common prefix with it
    # More choices of the same prompt (OpenAI's `n`): prefilled with this one, then each decodes
    # from its own copy of the cache.
    siblings: list[Pending] = field(default_factory=list)
    # A prompt with images: what the vision tower made of them (models/vision.py), once made,
    # and the job making them (engine/vision_jobs.py).
    features: Features | None = None
    vision_job: VisionJob | None = None

    @property
    def rope_delta(self) -> int:
        return self.features.rope_delta if self.features is not None else 0

    @property
    def todo(self) -> int:
        """Prompt tokens still to prefill (the last prompt token is fed by the first decode)."""
        return len(self.request.prompt_ids) - 1 - self.done

    @property
    def choices(self) -> list[Pending]:
        return [self, *self.siblings]

    @cached_property
    def tokens(self) -> np.ndarray:
        """The tokens its prefill computes: all of the prompt but the last."""
        return np.asarray(self.request.cache_keys()[:-1], dtype=np.int32)

    @property
    def rest(self) -> int:
        """Prompt tokens it still has to compute, its cached prefix left out."""
        return self.todo - (self.match.length if self.match is not None else 0)

    def without(self, gone: set[int]) -> Pending | None:
        """This sequence without its choices whose clients left: None if none is left; another
        choice takes the lead if this one's left."""
        staying = [p for p in self.choices if p.stream_id not in gone]
        if not staying:
            return None
        if staying[0] is not self:
            lead = staying[0]
            lead.match, lead.caches, lead.done = self.match, self.caches, self.done
            lead.last_chunk, lead.torn = self.last_chunk, self.torn
            lead.features, lead.vision_job = self.features, self.vision_job
        staying[0].siblings = staying[1:]
        return staying[0]


@dataclass(eq=False)
class PromptGroup:
    """Whole prompts prefilled together, one row each of a batched KV cache."""

    rows: list[Pending]
    tokens: np.ndarray  # [rows, columns]: the uncached rest of each prompt, right-padded
    caches: list[Any]  # per layer, batch caches


@dataclass(eq=False)
class _Progress:
    """A step's prefill as it goes."""

    budget: int  # prompt tokens left
    kv_room: int | None  # bytes of the KV memory budget left for prompts to start
    spent_s: float = 0.0  # the plan's prediction of the seconds spent (`PrefillPlan.cost_s`)
    admitted: list[Pending] = field(default_factory=list)  # prefilled alone, to join
    groups: list[PromptGroup] = field(default_factory=list)  # prefilled together, to join

    def rows(self) -> int:
        """The decode batch's rows the step's prefills will take."""
        return sum(len(p.choices) for p in self.admitted) + sum(len(g.rows) for g in self.groups)


# Joins prefilled sequences (every choice of each) to the decode batch: the rows and, per
# layer, a batch cache holding their prompts.
Join = Callable[[list[Pending], list[Any]], None]


class Prefill:
    """The waiting sequences, oldest first, and the passes that prefill them. Engine thread only."""

    def __init__(
        self,
        adapter: ModelAdapter,
        layout: CacheLayout,
        prefix_cache: PrefixCache,
        scheduler: Scheduler,
        metrics: EngineMetrics,
        *,
        grouped: bool,
        cancelled: Callable[[], set[int]],
        ping: Callable[[int], None],
        join: Join,
        cached: Callable[[int, int, str], None] = lambda stream_id, tokens, tier: None,
        memory: KVMemory | None = None,
        vision: VisionJobs | None = None,
    ) -> None:
        """`grouped`: whether several prompts may share a pass. `cancelled`: the stream ids whose
        clients left (polled during passes); `ping` sends a stream a keep-alive; `join` adds
        prefilled sequences to the decode batch; `cached` tells a stream how much of its prompt
        was reused after all; `memory`: the KV memory budget, if any; `vision`: where a vision
        model's prompts have their images encoded."""
        self.adapter = adapter
        self.layout = layout
        self.prefix_cache = prefix_cache
        self.scheduler = scheduler
        self.settings = scheduler.settings
        self.metrics = metrics
        self.grouped = grouped
        self._cancelled = cancelled
        self._ping = ping
        self._join = join
        self._cached = cached
        self.memory = memory
        self.vision = vision
        self.waiting: deque[Pending] = deque()
        # Taken from the queue by this step's prefill and not yet in the batch.
        self.joining: list[Pending] = []

    def refresh(self) -> None:
        """Before a step is planned: the prefix cache may hold more of a prompt not yet started
        than when it was looked up (the prefill it waited for, its own keys/values if it was
        preempted, or a burst's common prefix that the prompts ahead of it stored as they
        joined)."""
        stores = self.prefix_cache.stores
        for pending in self.waiting:
            if pending.caches is None and pending.looked_at < stores:
                self._look_again(pending)

    def run(self, plan: PrefillPlan, running: int) -> None:
        """Prefill beside `running` decoding rows as the step's `plan` says: in its order, up to
        its budget of prompt tokens; with streams decoding, within its time allowance (a prompt
        in prefill takes one chunk sized from its previous pass to what is left of it); new
        prompts start within the bytes of the KV memory budget the plan leaves them (None: no
        budget)."""
        self.waiting, held = self._ranked(plan.order)
        try:
            self._prefill(plan, running)
        finally:
            self.waiting.extend(held)

    def _prefill(self, plan: PrefillPlan, running: int) -> None:
        progress = _Progress(plan.budget, plan.kv_room)
        idle = not running
        while self.waiting and progress.budget > 0:
            self.ping()  # one step may prefill for long: a pass at a time
            room = self.settings.max_running - running - progress.rows()
            if room < len(self.waiting[0].choices):
                break
            group = (
                self._whole_prompts(progress.budget, room, progress.kv_room)
                if self.grouped
                else None
            )
            if group is not None:
                # Several short prompts that fit this step: one forward pass for all of them.
                self._prefill_group(group, plan, progress)
                if idle and progress.groups:
                    break
                continue
            if idle and progress.admitted:
                # With nothing decoding, the first stream to start ends the step (the next steps
                # prefill beside it), unless short prompts behind it fit one pass together:
                # beside decoding streams they would go a few per step (a burst's TTFT tail).
                break
            if not self._prefill_chunk(plan, progress, running):
                break
        if progress.admitted:
            self._join_one_by_one(progress.admitted)
        for group in progress.groups:
            self._join_group(group)
        self.joining = []

    def _prefill_group(self, group: PromptGroup, plan: PrefillPlan, progress: _Progress) -> None:
        for _ in group.rows:
            self.joining.append(self.waiting.popleft())
        if progress.kv_room is not None:
            progress.kv_room -= sum(self._reserve(p) for p in group.rows)
        self.metrics.prefill_tokens += sum(p.todo for p in group.rows)
        self.metrics.prefill_passes += 1
        if self._forward_group(group):
            progress.groups.append(group)
        else:
            self.metrics.requests_cancelled += len(group.rows)
        progress.budget -= group.tokens.size  # padding included: it is work all the same
        progress.spent_s += plan.cost_s(group.tokens.size)

    def _prefill_chunk(self, plan: PrefillPlan, progress: _Progress, running: int) -> bool:
        """The next chunk of the prompt at the head of the queue (all of it, if it fits); False
        where the step's prefill ends."""
        pending = self.waiting[0]
        if pending.torn:
            self._mend(pending)
        left_s = plan.left_s(progress.spent_s)
        last_chunk = plan.last_chunks.get(pending.stream_id)
        budget = progress.budget
        if left_s is not None and last_chunk is None and progress.spent_s:
            # Beside decoding streams, a second pass pays its own fixed part.
            budget = min(budget, int((left_s - plan.pass_s) / plan.token_s))
            if budget < min(pending.rest, self.settings.min_prefill_chunk):
                return False
        if pending.caches is None:
            if progress.kv_room is not None:
                need = self._reserve(pending)
                # Alone (nothing else holds or takes memory) a prompt starts even past the room:
                # one that cannot fit alone was refused at admission.
                others = running or progress.admitted or progress.groups or self._started()
                if need > progress.kv_room and others:
                    return False  # it waits for memory; nothing overtakes it
                progress.kv_room -= need
            self._start(pending)
        if pending.request.images is not None and pending.features is None:
            self._encode(pending)
        if left_s is None or last_chunk is None:
            steered, chunk = False, self.scheduler.chunk(budget, pending.todo)
        else:  # a prompt in prefill beside decoding streams: sized from its previous pass
            if left_s <= 0 and progress.spent_s:
                return False  # the step's allowance is spent
            steered = True
            chunk = self.scheduler.steered_chunk(
                last_chunk, pending.todo, max(left_s, 0.0), plan.pass_s
            )
        if chunk > 0:
            prompt = pending.request.prompt_ids
            tokens_in = mx.array(prompt[pending.done : pending.done + chunk])[None]
            pass_started = time.perf_counter()
            if not self._forward_prompt(tokens_in, pending):
                pending.torn = True
                return False  # its client left mid-chunk; the next step drops it
            took = time.perf_counter() - pass_started
            pending.last_chunk = chunk_cost(pending.last_chunk, chunk, took)
            pending.done += chunk
            progress.budget = 0 if steered else progress.budget - chunk
            progress.spent_s += plan.cost_s(chunk)
            self.metrics.prefill_tokens += chunk
            self.metrics.prefill_passes += 1
            if steered and pending.todo == 0:
                return False  # joining copies the batch's cache: the next step does it
        if pending.todo == 0:
            progress.admitted.append(self.waiting.popleft())
            self.joining.append(pending)
        return True

    def held_bytes(self) -> int:
        """What the prompts in prefill reserve of the KV memory budget."""
        return sum(self._reserve(p) for p in self.waiting if p.caches is not None)

    def _reserve(self, pending: Pending) -> int:
        assert self.memory is not None
        request = pending.request
        return self.memory.reserve(len(request.prompt_ids), request.max_tokens) * len(
            pending.choices
        )

    def _started(self) -> bool:
        return any(p.caches is not None for p in self.waiting)

    def _ranked(self, order: list[int]) -> tuple[deque[Pending], list[Pending]]:
        """The waiting sequences in `order`, and apart, those that wait for another one's
        prefill of their prefix (or for their images)."""
        by_id = {pending.stream_id: pending for pending in self.waiting}
        ranked = [by_id[stream_id] for stream_id in order]
        ready: deque[Pending] = deque()
        held: list[Pending] = []
        for index, pending in enumerate(ranked):
            if not self._images_ready(pending):
                held.append(pending)
            elif pending.caches is None and self._waits_for_prefix(pending, ranked[:index]):
                pending.held = True
                held.append(pending)
            else:
                ready.append(pending)
        return ready, held

    def _look_again(self, pending: Pending) -> None:
        """The prefix cache may hold more of the prompt than at admission: the prefill it waited
        for, or (preempted) its own keys/values."""
        held = pending.match.length if pending.match is not None else 0
        keys = pending.request.cache_keys()
        pending.looked_at = self.prefix_cache.stores
        match = self.prefix_cache.lookup(keys, int(pending.scaled), held)
        if match is not None:
            pending.match = match

    def _waits_for_prefix(self, pending: Pending, ahead: list[Pending]) -> bool:
        """Whether one of the sequences served before `pending` is computing more of its prefix
        (a chunk or more) than it can have now; where one has computed it already (attention
        keys/values: cut to the part they share), `pending` starts from that instead."""
        best = pending.match.length if pending.match is not None else 0
        promised = 0
        for other in ahead:
            if other.scaled != pending.scaled:
                continue
            shared = pending.shared.get(other.stream_id)
            if shared is None:
                shared = common_prefix(pending.tokens, other.tokens)
                pending.shared[other.stream_id] = shared
            if not self.layout.cuttable:
                # Only its whole prefill is kept (a snapshot, as it joins the batch).
                if shared == len(other.tokens):
                    promised = max(promised, shared)
            elif other.caches is not None and not other.torn and other.done >= shared:
                if shared - best >= self.prefix_cache.min_tokens:
                    # All its tokens, not just the done ones: its caches grow as it goes on,
                    # and a match shorter than its entry is cut to its length.
                    entry = CacheEntry(other.tokens, other.caches, 0)
                    pending.match, best = MemoryMatch(entry, shared), shared
                    pending.held = True
            else:
                promised = max(promised, shared)
        # A short shared prefix is cheaper computed again, in a pass with other prompts.
        return promised - best >= self.settings.max_prefill_chunk

    def ping(self) -> None:
        """A keep-alive for each waiting stream not pinged for the ping interval."""
        now = time.monotonic()
        for pending in self.waiting:
            if now - pending.last_ping >= self.settings.ping_interval_s:
                for choice in pending.choices:
                    self._ping(choice.stream_id)
                pending.last_ping = now

    def drop(self, gone: set[int]) -> int:
        """Drop the choices whose clients left (`gone`); returns how many sequences left the
        queue. What a dropped prompt prefilled goes to the prefix cache, so that the same request
        sent again (as Claude Code does after a stalled stream) resumes there."""
        waiting = len(self.waiting)
        staying = []
        for pending in self.waiting:
            if (kept := pending.without(gone)) is not None:
                staying.append(kept)
                continue
            if pending.vision_job is not None:
                pending.vision_job.abandoned = True  # the tower stops after its current part
            if pending.done and (caches := self._finished_part(pending)) is not None:
                self._store(pending, pending.done, caches)
        self.waiting = deque(staying)
        return waiting - len(self.waiting)

    def clear(self) -> list[int]:
        """Forget every sequence (after a failed step); returns their stream ids."""
        held = [c.stream_id for p in (*self.joining, *self.waiting) for c in p.choices]
        for pending in self.waiting:
            if pending.vision_job is not None:
                pending.vision_job.abandoned = True
        self.waiting.clear()
        self.joining = []
        return held

    def _whole_prompts(self, budget: int, room: int, kv_room: int | None) -> PromptGroup | None:
        """Two or more not yet started prompts at the head of the queue that fit `budget` (and
        `kv_room`) together (`Scheduler.group`), or None.

        Each row is the prompt's cached prefix (if any) followed by the rest of the prompt,
        right-padded to the longest rest.
        """
        rests = self.scheduler.group(
            (
                # Not a long prompt already being prefilled chunk by chunk, nor n choices, nor
                # one with images (its rows feed embeddings, one prompt a pass).
                None if p.caches is not None or p.siblings or p.request.images else p.rest
                for p in self.waiting
            ),
            budget,
            room,
        )
        if kv_room is not None:
            reserved = itertools.accumulate(self._reserve(p) for p in self.waiting)
            fit = sum(1 for _, total in zip(rests, reserved, strict=False) if total <= kv_room)
            rests = rests[:fit]
        if len(rests) < 2:
            return None
        rows = list(itertools.islice(self.waiting, len(rests)))
        for pending in rows:
            self._start(pending)
        rests = [p.todo for p in rows]  # a prefix that failed its disk read is computed
        width = max(rests)
        tokens = np.zeros((len(rows), width), dtype=np.uint32)
        for row, pending in enumerate(rows):
            tokens[row, : rests[row]] = pending.request.prompt_ids[pending.done : -1]
        caches = []
        for layer in zip(*(p.caches for p in rows if p.caches is not None), strict=True):
            cache = cache_kinds.merge(layer)
            cache.prepare(lengths=rests, right_padding=[width - rest for rest in rests])
            caches.append(cache)
        return PromptGroup(rows, tokens, caches)

    def _forward_group(self, group: PromptGroup) -> bool:
        """Prefill a group's prompts together; False if every one of its clients left meanwhile."""
        ids = {p.stream_id for p in group.rows}
        scaled = np.array([p.scaled for p in group.rows])
        started = time.perf_counter()
        if not self._forward(
            mx.array(group.tokens), group.caches, lambda gone: ids <= gone, scaled
        ):
            return False
        # The right padding moves to the left, where the decode batch expects it.
        for cache in group.caches:
            cache.finalize()
        mx.eval([cache_kinds.arrays(c) for c in group.caches])
        context = max(p.done for p in group.rows)
        self.scheduler.passed(group.tokens.size, time.perf_counter() - started, context)
        return True

    def _forward_prompt(self, tokens: mx.array, pending: Pending) -> bool:
        """Add `tokens` (the next of its prompt) to the pending sequence's KV cache; False if it
        was cancelled meanwhile."""
        assert pending.caches is not None
        features = pending.features
        start = pending.done
        inputs = features.chunk(start, start + tokens.shape[1]) if features is not None else None
        started = time.perf_counter()
        if not self._forward(
            tokens, pending.caches, lambda gone: pending.stream_id in gone, pending.scaled, inputs
        ):
            return False
        self.scheduler.passed(tokens.size, time.perf_counter() - started, start)
        return True

    def _forward(
        self,
        tokens: mx.array,
        caches: list[Any],
        left: Callable[[set[int]], bool],
        scaled: ScaledRows,
        inputs: dict[str, Any] | None = None,
    ) -> bool:
        """Prefill `tokens` into `caches`; False once `left(cancelled stream ids)` says its
        clients went away (checked after each layer, where the model allows)."""
        return self.adapter.prefill(tokens, caches, lambda: left(self._cancelled()), scaled, inputs)

    def _images_ready(self, pending: Pending) -> bool:
        """Whether the prompt's images are encoded, or need not be: those its cached prefix
        holds. Else its vision job is started (engine/vision_jobs.py), if it was not."""
        images = pending.request.images
        if images is None or pending.features is not None:
            return True
        job = pending.vision_job
        if job is None:
            cached = pending.match.length if pending.match is not None else pending.done
            if images.within(cached):
                return True  # (its positions are made as it starts: `_encode`)
            assert self.vision is not None
            job = pending.vision_job = self.vision.submit(pending.request.prompt_ids, images)
        return job.done.is_set()

    def blocked_on_vision(self) -> bool:
        """Whether every waiting prompt waits for its vision job."""
        return bool(self.waiting) and all(
            p.vision_job is not None and not p.vision_job.done.is_set() for p in self.waiting
        )

    def _encode(self, pending: Pending) -> None:
        """The prompt's features (it has started): its vision job's, or, its images all in its
        cached prefix, just its positions."""
        from mlxgate.models.vision import VisionAdapter

        job = pending.vision_job
        if job is not None:
            if job.features is None:
                raise RuntimeError(f"the vision tower failed: {job.error}")
            pending.features = job.features
            self.metrics.vision_s.append(job.seconds)
            return
        adapter, images = self.adapter, pending.request.images
        assert isinstance(adapter, VisionAdapter) and images is not None
        ids = pending.request.prompt_ids
        if images.within(pending.done):
            pending.features = adapter.positions(ids, images.inputs)
        else:  # its cached prefix failed its disk read: the tower after all, here
            pending.features = adapter.features(ids, images.inputs, lambda: False)

    def _mend(self, pending: Pending) -> None:
        """A torn prefill that goes on (another choice of its prompt leads now): its caches are
        cut back to what it finished, or it starts over where they cannot be."""
        pending.caches = self._finished_part(pending)
        if pending.caches is None:
            pending.done = 0
        pending.torn = False

    def _finished_part(self, pending: Pending) -> list[Any] | None:
        """Caches holding just the `done` prompt tokens a prefill finished: after a torn pass, cut
        back to them; None where a torn recurrent state or window cannot be."""
        if not pending.torn:
            return pending.caches
        if self.layout.cuttable:
            assert pending.caches is not None
            return [cache_kinds.cut(c, pending.done) for c in pending.caches]
        return None

    def _start(self, pending: Pending) -> None:
        if pending.sampler is None:
            self.metrics.queue_wait_s.append(time.monotonic() - pending.submitted_at)
        if pending.match is not None:
            pending.caches = pending.match.caches()
            pending.done = pending.match.length
            m = self.metrics
            m.cache_hit_tokens += pending.match.length
            if pending.held and isinstance(pending.match, MemoryMatch):
                m.inflight_hit_tokens += pending.match.length
            if pending.sampler is None and pending.match.length != pending.reported:
                tier = "in-flight" if pending.held else pending.match.tier
                for choice in pending.choices:
                    self._cached(choice.stream_id, pending.match.length, tier)
            pending.match = None
        else:
            pending.caches = self.adapter.make_cache()

    def _store(self, pending: Pending, tokens: int, caches: list[Any]) -> None:
        """Keep the state of the first `tokens` prompt tokens for prompts served alike."""
        prompt = pending.request.cache_keys()[:tokens]
        self.prefix_cache.store(prompt, caches, variant=int(pending.scaled))

    def _join_one_by_one(self, admitted: list[Pending]) -> None:
        for pending in admitted:
            assert pending.caches is not None
            self._store(pending, pending.done, pending.caches)
            # One at a time: together they would be padded to the longest before joining.
            rows = pending.choices
            self._join(rows, [cache_kinds.batch_of(c, len(rows)) for c in pending.caches])
            pending.caches = None  # the batch shares their data: held here, its first write copies

    def _join_group(self, group: PromptGroup) -> None:
        for row, pending in enumerate(group.rows):
            own = [cache.extract(row) for cache in group.caches]  # copies, padding left out
            self._store(pending, len(pending.request.prompt_ids) - 1, own)
        self._join(group.rows, group.caches)
