"""The engine thread: the only thread that touches MLX. Continuous batching under a token budget.

Every step decodes one token for each running sequence, then spends what is left of the step's
token budget on prefilling waiting prompts, so a long prompt never stalls running streams for
more than a budget's worth of compute. A prompt joins the running batch once all but its last
token is in the KV cache; that last token is its first decode input.

While few sequences decode, a decode step may be a verify pass instead: rows that guess their
next tokens from their own prompt and output (engine/speculation.py) feed them after their input
token, and keep those the model confirms.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxgate._native import ErrorKind, FinishReason, Reader, Router
from mlxgate.engine import batch_check, cache_kinds, heap
from mlxgate.engine.batch import FREE, DecodeBatch
from mlxgate.engine.batch_sampler import BatchSampler
from mlxgate.engine.cache_kinds import CacheLayout
from mlxgate.engine.constraints import Vocabulary
from mlxgate.engine.contract import EngineStopped, GenerationRequest, PromptTooLong, QueueFull
from mlxgate.engine.drafter import DraftModel
from mlxgate.engine.metrics import EngineMetrics
from mlxgate.engine.prefix_cache import PrefixCache, PrefixMatch
from mlxgate.engine.sampling import Sampler
from mlxgate.engine.settings import EngineSettings
from mlxgate.engine.speculation import Drafts, Speculation
from mlxgate.models import LoadedModel
from mlxgate.models.adapter import ModelAdapter
from mlxgate.models.rope_switch import ScaledRows

log = logging.getLogger("mlxgate.engine")

# Prompts prefilled in one batched forward pass at most.
MAX_GROUP_ROWS = 32


def _ema(previous: float | None, sample: float, weight: float = 0.2) -> float:
    return sample if previous is None else previous + weight * (sample - previous)


@dataclass(eq=False)
class _Pending:
    """A sequence from admission until it joins the running batch."""

    stream_id: int
    request: GenerationRequest
    match: PrefixMatch | None
    scaled: bool = False  # served with the scaled rope (models/rope_switch.py)
    submitted_at: float = field(default_factory=time.monotonic)
    last_ping: float = field(default_factory=time.monotonic)
    caches: list[Any] | None = None  # per layer (`model.make_cache()`), once prefill started
    done: int = 0  # prompt tokens whose keys/values are in `caches`
    last_chunk: tuple[int, float] | None = None  # (tokens, seconds) of its latest prefill pass
    torn: bool = False  # a pass stopped part way: `caches` hold more than `done` in some layers
    # More choices of the same prompt (OpenAI's `n`): prefilled with this one, then each decodes
    # from its own copy of the cache.
    siblings: list[_Pending] = field(default_factory=list)

    @property
    def todo(self) -> int:
        """Prompt tokens still to prefill (the last prompt token is fed by the first decode)."""
        return len(self.request.prompt_ids) - 1 - self.done

    @property
    def choices(self) -> list[_Pending]:
        return [self, *self.siblings]

    def without(self, gone: set[int]) -> _Pending | None:
        """This sequence without its choices whose clients left: None if none is left; another
        choice takes the lead if this one's left."""
        staying = [p for p in self.choices if p.stream_id not in gone]
        if not staying:
            return None
        if staying[0] is not self:
            lead = staying[0]
            lead.match, lead.caches, lead.done = self.match, self.caches, self.done
            lead.last_chunk, lead.torn = self.last_chunk, self.torn
        staying[0].siblings = staying[1:]
        return staying[0]


@dataclass(eq=False)
class _PromptGroup:
    """Whole prompts prefilled together, one row each of a batched KV cache."""

    rows: list[_Pending]
    tokens: np.ndarray  # [rows, columns]: the uncached rest of each prompt, right-padded
    caches: list[Any]  # per layer, batch caches


class Engine:
    """Owns the model on one thread; implements `Generator`. `admit` returns a stream reader at
    once and never blocks. The router decides when each stream ends; the engine drops the rows
    it reports."""

    def __init__(
        self,
        loaded: LoadedModel,
        router: Router,
        settings: EngineSettings | None = None,
        end_ids: list[int] | None = None,
        draft_model: nn.Module | None = None,
    ) -> None:
        """`end_ids`: the tokens that end a reply (the tokenizer's end-of-sequence ids unless
        given): where a grammar lets a constrained reply end. `draft_model`: a smaller model
        with the same tokenizer that guesses tokens ahead (else prompt lookup guesses)."""
        self.loaded = loaded
        self.model = loaded.model
        self.router = router
        self.settings = settings or EngineSettings()
        self.metrics = EngineMetrics()
        self._adapter = ModelAdapter(self.model)
        # An engine around a bare model (tests, benchmarks) has no tokenizer, and no grammars.
        tokenizer = loaded.tokenizer
        self.vocabulary = (
            Vocabulary(tokenizer.tokenizer, end_ids or sorted(tokenizer.eos_ids))
            if tokenizer is not None
            else None
        )
        # Raises UnsupportedCache for a layer cache the engine cannot batch: at start-up.
        self.layout = CacheLayout.of(self._adapter.make_cache())
        self.prefix_cache = PrefixCache(
            self.settings.prefix_cache_mb << 20, cuttable=self.layout.cuttable
        )
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
        self.speculation = self._make_speculation(draft_model)
        self._gone: set[int] = set()  # cancelled stream ids not yet dropped
        # Measured as the engine runs: a decode step, and one prefilled token (seconds).
        self._decode_s: float | None = None
        self._prefill_token_s: float | None = None
        self._over_since: dict[int, float] = {}  # stream id -> when its reader fell over the bound
        self._ids = itertools.count(1)
        self._incoming: deque[_Pending] = deque()
        self._wakeup = threading.Condition()
        self._running = threading.Event()
        self._thread: threading.Thread | None = None
        # Engine-thread state.
        self._waiting: deque[_Pending] = deque()
        # Taken from the queue by this step's prefill and not yet in the batch.
        self._joining: list[_Pending] = []
        self._batch = DecodeBatch(self.layout, self._banded)
        self._sampler = BatchSampler()  # the batch's: made and dropped with it
        self._trim_heap = heap.trimmer()
        self._heap_trimmed_at = 0.0

    def _make_speculation(self, draft_model: nn.Module | None) -> Speculation | None:
        s = self.settings
        if not s.max_draft_tokens or s.speculation_max_rows < 1:
            return None
        if not self.layout.cuttable:
            log.info(
                "speculative decoding is off: this model's layers (%s) cannot take back the "
                "positions of rejected guesses",
                self.layout.describe(),
            )
            return None
        speculation = Speculation(s.max_draft_tokens, self.loaded.context_length)
        if draft_model is not None:
            speculation.draft_model = DraftModel(
                draft_model,
                s.prefix_cache_mb << 20,
                s.max_prefill_chunk,
                batched=s.max_running > 1 and s.speculation_max_rows > 1,
            )
            log.info(
                "speculative decoding: a draft model (%s) guesses up to %d tokens ahead",
                speculation.draft_model.layout.describe(),
                s.max_draft_tokens,
            )
        return speculation

    def admit(self, request: GenerationRequest) -> Reader:
        """Open the request's stream and queue it, or raise an AdmissionError."""
        return self.admit_all([request])[0]

    def admit_all(self, requests: Sequence[GenerationRequest]) -> list[Reader]:
        """Requests with one prompt (the choices of OpenAI's `n`): queued as one sequence,
        prefilled once; each then decodes on its own copy of the cache, into its own stream."""
        if not self._running.is_set():
            raise EngineStopped()
        prompt_ids = requests[0].prompt_ids
        assert all(r.prompt_ids == prompt_ids for r in requests), "choices share their prompt"
        prompt_tokens = len(prompt_ids)
        context = self.loaded.context_length
        if prompt_tokens >= context:  # at least one token must fit after the prompt
            raise PromptTooLong(prompt_tokens, context)
        queued = len(self._incoming) + self.metrics.queue_depth
        if queued >= self.settings.max_queued:
            raise QueueFull(retry_after_s=1 + queued // 8)
        served = self.loaded.context
        window = served.window(prompt_tokens, requests[0].max_tokens) if served else context
        scaled = window > (served.native if served else context)
        # One lookup for every choice: a match is immutable, and each start copies its caches.
        match = self.prefix_cache.lookup(prompt_ids, variant=int(scaled))
        choices = [_Pending(next(self._ids), r, match, scaled) for r in requests]
        # Choices decode together; where they cannot (more than may run at once), each is a
        # sequence of its own, the prefix cache sharing what it can.
        together = len(choices) <= self.settings.max_running
        # Opened and queued as one: a cancel the engine polls finds the request somewhere.
        with self._wakeup:
            readers = [
                self.router.open(
                    pending.stream_id,
                    pending.request.stream,
                    prompt_tokens=prompt_tokens,
                    cached_tokens=match.length if match else 0,
                    max_tokens=min(pending.request.max_tokens or window, window - prompt_tokens),
                )
                for pending in choices
            ]
            if together:
                choices[0].siblings = choices[1:]
                self._incoming.append(choices[0])
            else:
                self._incoming.extend(choices)
            self._wakeup.notify()
        return readers

    def start(self) -> None:
        self._running.set()
        self._thread = threading.Thread(target=self._run, name="mlxgate-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._running.clear()
        with self._wakeup:
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        for pending in [*self._incoming, *self._waiting]:
            for choice in pending.choices:
                self.router.fail(
                    choice.stream_id, ErrorKind.UNAVAILABLE, "the server is shutting down"
                )
        for stream_id in self._batch.running_ids:
            self.router.fail(stream_id, ErrorKind.UNAVAILABLE, "the server is shutting down")

    # --- engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        # MLX streams are per thread: every array the engine evaluates is made on this thread.
        self._batch, self._sampler = DecodeBatch(self.layout, self._banded), BatchSampler()
        if self.speculation is not None:
            self.speculation.reset()
        while self._running.is_set():
            with self._wakeup:
                if not self._has_work():
                    self._wakeup.wait(timeout=1.0)
            self._take_incoming()
            worked = self._has_work()
            try:
                self._step()
            except Exception as exc:
                log.exception("engine step failed; failing the affected streams")
                self._fail_all(f"generation failed: {exc}")
            if worked:
                self._tidy_heap()

    def _has_work(self) -> bool:
        return bool(self._incoming or self._waiting or len(self._batch))

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
        held = [c.stream_id for p in (*self._joining, *self._waiting) for c in p.choices]
        for stream_id in dict.fromkeys([*self._batch.running_ids, *held]):
            self.router.fail(stream_id, ErrorKind.INTERNAL, message)
        self._waiting.clear()
        self._joining = []
        self._batch, self._sampler = DecodeBatch(self.layout, self._banded), BatchSampler()
        if self.speculation is not None:
            self.speculation.reset()

    def _step(self) -> None:
        self._drop_cancelled()
        self._update_gauges()
        if not (self._waiting or len(self._batch)):
            return
        started = time.perf_counter()
        decoding = len(self._batch)
        if decoding:
            self._decode()
            self._decode_s = _ema(self._decode_s, time.perf_counter() - started)
        if self._waiting:
            prefill_started = time.perf_counter()
            allowance_s = self._prefill_allowance_s(decoding)
            prefilled = self._prefill(self._prefill_budget(decoding, allowance_s), allowance_s)
            if prefilled >= self.settings.min_prefill_chunk:
                per_token = (time.perf_counter() - prefill_started) / prefilled
                self._prefill_token_s = _ema(self._prefill_token_s, per_token)
        self._ping_waiting()
        self._cancel_stalled()
        elapsed = time.perf_counter() - started
        m = self.metrics
        with m.lock:
            m.steps += 1
            m.last_step_s = elapsed
            m.busy_s += elapsed
            if decoding:
                m.step_s.append(elapsed)
        self._update_gauges()

    def _cancel_stalled(self) -> None:
        """The engine never waits for a reader: a stream unread past the stall timeout is ended."""
        over = set(self.router.over_bound())
        now = time.monotonic()
        self._over_since = {sid: self._over_since.get(sid, now) for sid in over}
        stalled = [
            sid
            for sid, since in self._over_since.items()
            if now - since > self.settings.stall_timeout_s
        ]
        for stream_id in stalled:
            log.warning("stream %d: client stopped reading; cancelling its generation", stream_id)
            self.router.fail(
                stream_id, ErrorKind.OVERLOADED, "the client stopped reading the stream"
            )
            del self._over_since[stream_id]
        if stalled:
            ended = np.isin(self._batch.stream_ids, stalled)
            self.metrics.requests_cancelled += int(ended.sum())
            self._batch.drop(ended)

    def _prefill_allowance_s(self, decoding: int) -> float | None:
        """Seconds of prefill this step may add to decoding; None when nothing limits it."""
        s = self.settings
        if not decoding or s.step_token_budget or self._decode_s is None:
            return None
        # More prompts waiting than streams decoding: the waiting clients get the larger share.
        stretch = max(1.0, len(self._waiting) / decoding)
        return (s.max_step_ratio - 1.0) * self._decode_s * stretch

    def _prefill_budget(self, decoding: int, allowance_s: float | None) -> int:
        """Prompt tokens this step may prefill without stalling the `decoding` streams too long."""
        s = self.settings
        if not decoding:
            return s.max_prefill_tokens  # nobody waits on this step: go for throughput
        if s.step_token_budget:
            return max(s.min_prefill_chunk, s.step_token_budget - decoding)
        if allowance_s is None or self._prefill_token_s is None:
            return s.min_prefill_chunk
        fits = allowance_s / self._prefill_token_s
        return int(min(s.max_prefill_tokens, max(s.min_prefill_chunk, fits)))

    def _steered_chunk(self, pending: _Pending, allowance_s: float) -> int:
        """The next chunk of a prompt in prefill, sized from its own previous pass.

        A pass costs a fixed part (every weight is read once) plus a part per token that grows
        with the prompt's length so far, which a global per-token rate does not capture.
        """
        assert pending.last_chunk is not None
        tokens, took = pending.last_chunk
        steered = int(tokens * allowance_s / max(took, 1e-3))
        steered = min(2 * tokens, max(tokens // 2, steered))
        s = self.settings
        return min(pending.todo, s.max_prefill_chunk, max(s.min_prefill_chunk, steered))

    def _update_gauges(self) -> None:
        self.metrics.queue_depth = len(self._waiting)
        self.metrics.running = len(self._batch)

    def _poll_cancelled(self) -> set[int]:
        self._gone.update(self.router.cancelled())
        return self._gone

    def _take_incoming(self) -> None:
        with self._wakeup:
            while self._incoming:
                self._waiting.append(self._incoming.popleft())

    def _drop_cancelled(self) -> None:
        gone = self._poll_cancelled()
        if not gone:
            return
        # A request cancelled as soon as it was admitted may still be incoming.
        self._take_incoming()
        self._gone = set()
        waiting = len(self._waiting)
        staying = []
        for pending in self._waiting:
            if (kept := pending.without(gone)) is not None:
                staying.append(kept)
            else:
                self._keep_prefilled(pending)
        self._waiting = deque(staying)
        ended = np.isin(self._batch.stream_ids, list(gone))
        self._batch.drop(ended)
        self.metrics.requests_cancelled += waiting - len(self._waiting) + int(ended.sum())

    def _keep_prefilled(self, pending: _Pending) -> None:
        """A prompt whose clients left during its prefill: what it prefilled goes to the prefix
        cache, so that the same request sent again (as Claude Code does after a stalled
        stream) resumes there."""
        if pending.done and (caches := self._finished_part(pending)) is not None:
            self._store(pending, pending.done, caches)

    def _store(self, pending: _Pending, tokens: int, caches: list[Any]) -> None:
        """Keep the state of the first `tokens` prompt tokens for prompts served alike."""
        prompt = pending.request.prompt_ids[:tokens]
        self.prefix_cache.store(prompt, caches, variant=int(pending.scaled))

    def _finished_part(self, pending: _Pending) -> list[Any] | None:
        """Caches holding just the `done` prompt tokens a prefill finished: after a torn pass, cut
        back to them; None where a torn recurrent state or window cannot be."""
        if not pending.torn:
            return pending.caches
        if self.layout.cuttable:
            assert pending.caches is not None
            return [cache_kinds.cut(c, pending.done) for c in pending.caches]
        return None

    def _decode(self) -> None:
        """One token per running row, or more for rows whose guesses the step confirms."""
        batch = self._batch
        speculation = self.speculation
        drafts = None
        if speculation is not None and len(batch) <= self.settings.speculation_max_rows:
            drafts = speculation.drafts(batch.stream_ids)
        if drafts is None:
            logits = self._adapter.decode(batch.inputs, batch.caches, self._scaled_rows())
            inputs = self._sampler.sample(logits, batch.samplers, self.vocabulary)
            mx.eval(inputs)
            tokens = np.array(inputs)[:, None]
            kept = np.zeros(len(tokens), dtype=np.int64)
        else:
            tokens, kept = self._verify(drafts)
            inputs = mx.array(tokens[np.arange(len(tokens)), kept])  # each row's last token
        slot_ids = batch.stream_ids
        # Free slots were computed too: their tokens go nowhere.
        self._sampler.advance(inputs)
        batch.advance(inputs)
        if speculation is not None:
            self._guessed(speculation, slot_ids, drafts, kept, tokens)
        if sampled := self._sampler.logprobs(batch.stream_ids):
            self.router.logprobs(sampled)
        # Each row's emitted tokens in order: the router ends a stream at the first that ends it.
        emitted = (np.arange(tokens.shape[1]) <= kept[:, None]) & (slot_ids != FREE)[:, None]
        token_ids = tokens[emitted]
        ended = self.router.step(
            np.broadcast_to(slot_ids[:, None], tokens.shape)[emitted], token_ids
        )
        self.metrics.decode_tokens += len(token_ids)
        finished = [sid for sid, why in ended if why != FinishReason.CANCELLED]
        if finished:
            self.metrics.requests_finished += len(finished)
            batch.drop(np.isin(batch.stream_ids, finished))
        self._gone.update(sid for sid, why in ended if why == FinishReason.CANCELLED)
        if self._gone:
            self._drop_cancelled()

    def _verify(self, drafts: Drafts) -> tuple[np.ndarray, np.ndarray]:
        """One pass over every row's input token and its guesses: the tokens sampled at each
        position [slots, width] and how many guesses each row keeps; the caches keep just those."""
        batch = self._batch
        guesses = mx.array(drafts.tokens.astype(np.uint32))
        inputs = mx.concatenate([batch.inputs[:, None], guesses], axis=1)
        logits = self._adapter.verify(inputs, batch.caches, self._scaled_rows())
        tokens = self._sampler.sample_positions(
            logits, drafts.counts, batch.samplers, self.vocabulary
        )
        kept = drafts.kept(tokens)
        self._sampler.keep(kept)
        batch.rewind(kept, drafts.width)
        return tokens, kept

    def _scaled_rows(self) -> ScaledRows:
        return self._batch.scaled if self._adapter.switched_rope else True

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

    def _prefill(self, budget: int, allowance_s: float | None) -> int:
        """Prefill up to `budget` prompt tokens, oldest sequence first; returns how many.

        With streams decoding (`allowance_s` set), a prompt already in prefill takes one chunk
        sized from its previous pass instead.
        """
        admitted: list[_Pending] = []
        groups: list[_PromptGroup] = []
        idle = not len(self._batch)
        spent = 0
        while self._waiting and budget > 0:
            self._ping_waiting()  # one step may prefill for long: a pass at a time
            room = self.settings.max_running - len(self._batch)
            room -= sum(len(p.choices) for p in admitted) + sum(len(g.rows) for g in groups)
            if room < len(self._waiting[0].choices):
                break
            group = None if self.batch_problems.prefill else self._whole_prompts(budget, room)
            if group is not None:
                # Several short prompts that fit this step: one forward pass for all of them.
                for _ in group.rows:
                    self._joining.append(self._waiting.popleft())
                self.metrics.prefill_tokens += sum(p.todo for p in group.rows)
                self.metrics.prefill_passes += 1
                if self._forward_group(group):
                    groups.append(group)
                else:
                    self.metrics.requests_cancelled += len(group.rows)
                budget -= group.tokens.size  # padding included: it is work all the same
                spent += group.tokens.size
                if idle and groups:
                    break
                continue
            pending = self._waiting[0]
            if pending.torn:
                self._mend(pending)
            if pending.caches is None:
                self._start_prefill(pending)
            steered = allowance_s is not None and pending.last_chunk is not None
            if steered:
                chunk = self._steered_chunk(pending, allowance_s)  # type: ignore[arg-type]
            else:
                chunk = min(budget, pending.todo, self.settings.max_prefill_chunk)
            if chunk > 0:
                prompt = pending.request.prompt_ids
                tokens_in = mx.array(prompt[pending.done : pending.done + chunk])[None]
                pass_started = time.perf_counter()
                if not self._forward_prompt(tokens_in, pending):
                    pending.torn = True
                    break  # its client left mid-chunk; the next step drops it
                pending.last_chunk = (chunk, time.perf_counter() - pass_started)
                pending.done += chunk
                budget = 0 if steered else budget - chunk
                spent += chunk
                self.metrics.prefill_tokens += chunk
                self.metrics.prefill_passes += 1
                if steered and pending.todo == 0:
                    break  # joining copies the batch's cache: the next step does it, not this one
            if pending.todo == 0:
                admitted.append(self._waiting.popleft())
                self._joining.append(pending)
            if idle and admitted:
                break  # the first stream can start; the next steps prefill beside it
        if admitted:
            self._join_batch(admitted)
        for group in groups:
            self._join_group(group)
        self._joining = []
        return spent

    def _whole_prompts(self, budget: int, room: int) -> _PromptGroup | None:
        """Two or more not yet started prompts at the head of the queue that fit `budget` together.

        Each row is the prompt's cached prefix (if any) followed by the rest of the prompt,
        right-padded to the longest rest; a prompt joins only while padding stays under a quarter
        of the work.
        """
        rests: list[int] = []
        for pending in itertools.islice(self._waiting, min(room, MAX_GROUP_ROWS)):
            if pending.caches is not None or pending.siblings:
                break  # a long prompt already being prefilled chunk by chunk, or n choices
            rest = pending.todo - (pending.match.length if pending.match else 0)
            if rest == 0 or rest > self.settings.max_prefill_chunk:
                break
            padded = max(rest, *rests, 0) * (len(rests) + 1)
            if padded > budget or padded > 1.25 * (sum(rests) + rest):
                break
            rests.append(rest)
        if len(rests) < 2:
            return None
        rows = list(itertools.islice(self._waiting, len(rests)))
        for pending in rows:
            self._start_prefill(pending)
        width = max(rests)
        tokens = np.zeros((len(rows), width), dtype=np.uint32)
        for row, pending in enumerate(rows):
            tokens[row, : rests[row]] = pending.request.prompt_ids[pending.done : -1]
        caches = []
        for layer in zip(*(p.caches for p in rows if p.caches is not None), strict=True):
            cache = cache_kinds.merge(layer)
            cache.prepare(lengths=rests, right_padding=[width - rest for rest in rests])
            caches.append(cache)
        return _PromptGroup(rows, tokens, caches)

    def _forward_group(self, group: _PromptGroup) -> bool:
        """Prefill a group's prompts together; False if every one of its clients left meanwhile."""
        ids = {p.stream_id for p in group.rows}
        scaled = np.array([p.scaled for p in group.rows])
        if not self._forward(
            mx.array(group.tokens), group.caches, lambda gone: ids <= gone, scaled
        ):
            return False
        # The right padding moves to the left, where the decode batch expects it.
        for cache in group.caches:
            cache.finalize()
        mx.eval([cache_kinds.arrays(c) for c in group.caches])
        return True

    def _forward_prompt(self, tokens: mx.array, pending: _Pending) -> bool:
        """Add `tokens` to the pending sequence's KV cache; False if it was cancelled meanwhile."""
        assert pending.caches is not None
        return self._forward(
            tokens, pending.caches, lambda gone: pending.stream_id in gone, pending.scaled
        )

    def _forward(
        self,
        tokens: mx.array,
        caches: list[Any],
        left: Callable[[set[int]], bool],
        scaled: ScaledRows,
    ) -> bool:
        """Prefill `tokens` into `caches`; False once `left(cancelled stream ids)` says its
        clients went away (checked after each layer, where the model allows)."""
        return self._adapter.prefill(tokens, caches, lambda: left(self._poll_cancelled()), scaled)

    def _mend(self, pending: _Pending) -> None:
        """A torn prefill that goes on (another choice of its prompt leads now): its caches are
        cut back to what it finished, or it starts over where they cannot be."""
        pending.caches = self._finished_part(pending)
        if pending.caches is None:
            pending.done = 0
        pending.torn = False

    def _start_prefill(self, pending: _Pending) -> None:
        if pending.match is not None:
            pending.caches = pending.match.caches()
            pending.done = pending.match.length
            self.metrics.cache_hit_tokens += pending.match.length
            pending.match = None
        else:
            pending.caches = self._adapter.make_cache()

    def _join_batch(self, admitted: list[_Pending]) -> None:
        for pending in admitted:
            assert pending.caches is not None
            self._store(pending, pending.done, pending.caches)
            # One at a time: together they would be padded to the longest before joining.
            rows = pending.choices
            self._add_rows(rows, [cache_kinds.batch_of(c, len(rows)) for c in pending.caches])

    def _join_group(self, group: _PromptGroup) -> None:
        for row, pending in enumerate(group.rows):
            own = [cache.extract(row) for cache in group.caches]  # copies, padding left out
            self._store(pending, len(pending.request.prompt_ids) - 1, own)
        self._add_rows(group.rows, group.caches)

    def _add_rows(self, joining: list[_Pending], caches: list[Any]) -> None:
        now = time.monotonic()
        with self.metrics.lock:
            self.metrics.ttft_s.extend(now - p.submitted_at for p in joining)
        if self.speculation is not None:
            for p in joining:
                self.speculation.start(p.stream_id, p.request)
        self._batch.add(
            caches,
            [len(p.request.prompt_ids) - 1 for p in joining],
            [p.stream_id for p in joining],
            [Sampler(p.request.sampling, p.request.grammar) for p in joining],
            [p.request.prompt_ids[-1] for p in joining],
            [p.scaled for p in joining],
        )

    def _ping_waiting(self) -> None:
        now = time.monotonic()
        for pending in self._waiting:
            if now - pending.last_ping >= self.settings.ping_interval_s:
                for choice in pending.choices:
                    self.router.ping(choice.stream_id)
                pending.last_ping = now
