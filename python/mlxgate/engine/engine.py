"""The engine: admission, and the thread that owns the model and runs its steps.

The engine thread is the only thread that touches MLX. Between two steps it takes the admitted
requests in (engine/admission.py) and makes the next step's plan (engine/plan.py), the
scheduler's decisions in it (engine/scheduler.py); then it runs the plan: one decode step for
the running sequences (engine/decoder.py; a verify pass where rows guess ahead), then the plan's
prefill of waiting prompts (engine/prefill.py), within a budget that keeps a long prompt from
stalling running streams for more than the budget's worth of compute.

The KV caches the engine holds stay within a memory budget (engine/kv_memory.py): when the
batch's would outgrow it, the youngest sequence is preempted (its keys/values kept in the prefix
cache) and resumes from there, exactly, once there is room.

With the model sharded over ranks (engine/lockstep.py), rank 0 makes each plan and every rank
runs it: the rank-specific part of a step is the plan's one share, and the sampled tokens'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import mlx.nn as nn

from mlxgate._native import ErrorKind, Reader, Router
from mlxgate.engine import batch_check, disk_cache, heap, kv_memory
from mlxgate.engine.admission import Admission
from mlxgate.engine.cache_kinds import CacheLayout
from mlxgate.engine.constraints import Vocabulary
from mlxgate.engine.contract import GenerationRequest
from mlxgate.engine.decoder import Decoder
from mlxgate.engine.lockstep import Lockstep, RanksDiverged
from mlxgate.engine.metrics import EngineMetrics
from mlxgate.engine.plan import StepPlan
from mlxgate.engine.prefill import Prefill
from mlxgate.engine.prefix_cache import PrefixCache
from mlxgate.engine.scheduler import PrefillPlan, Scheduler
from mlxgate.engine.settings import EngineSettings
from mlxgate.engine.speculation import Drafts, Speculation
from mlxgate.engine.vision_jobs import VisionJobs
from mlxgate.models import LoadedModel
from mlxgate.models.adapter import ModelAdapter

log = logging.getLogger("mlxgate.engine")

# How often an engine with nothing to do but wait for vision towers looks for cancels.
VISION_POLL_S = 0.05
# Across ranks, the times a prefill pass checks for cancels (each check a collective; one
# process checks after every layer).
STOP_CHECKS_ACROSS_RANKS = 4


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
        several (engine/lockstep.py): rank 0 plans, the others follow."""
        self.loaded = loaded
        self.lockstep = lockstep or Lockstep()
        self._turn = turn
        self.model = loaded.model
        self.router = router
        self.settings = settings or EngineSettings()
        self.metrics = EngineMetrics()
        self._adapter, vision = self._model_adapter(vision_turn)
        # An engine around a bare model (tests, benchmarks) has no tokenizer, and no grammars.
        tokenizer = loaded.tokenizer
        self.vocabulary: Vocabulary | None = None
        if tokenizer is not None:
            self.vocabulary = Vocabulary(tokenizer.tokenizer, end_ids or sorted(tokenizer.eos_ids))
        # Raises UnsupportedCache for a layer cache the engine cannot batch: at start-up.
        self.layout = CacheLayout.of(self._adapter.make_cache(), self._adapter.watched)
        self._caches()
        # Bands of rows need the attention that attends band by band.
        banded = self._adapter.banded_attention
        self.batch_problems = batch_check.checked(self._adapter, self.layout, banded)
        if self.batch_problems.decode is not None:
            self.settings = dataclasses.replace(self.settings, max_running=1)
        # Guessing tokens ahead (engine/speculation.py); None where it is off.
        self.speculation = Speculation.configured(
            self.settings, self.layout, loaded.context_length, draft_model
        )
        self.metrics.guessing(self.speculation.drafter if self.speculation else "none")
        self.admission = Admission(
            loaded,
            self.settings,
            self.kv_memory,
            self.prefix_cache,
            self.metrics,
            lambda: self.router,
            look_up=self.lockstep.ranks == 1,
        )
        self._gone: set[int] = set()  # cancelled stream ids not yet dropped
        self._thread: threading.Thread | None = None
        self._engine_thread_state(banded, vision)

    def _model_adapter(
        self, vision_turn: Callable[[], AbstractContextManager[Any]]
    ) -> tuple[ModelAdapter, VisionJobs | None]:
        """The model's calls, and for a vision model, where its prompts' images are encoded."""
        kv_bits, group_size = self.settings.kv_bits, self.settings.kv_group_size
        vision = None
        if self.loaded.vision is not None:
            from mlxgate.models.vision import VisionAdapter

            tower = VisionAdapter(self.model, kv_bits, group_size)
            adapter: ModelAdapter = tower
            vision = VisionJobs(tower, lambda: self.admission.notify(), vision_turn)
        else:
            adapter = ModelAdapter(self.model, kv_bits, group_size)
        if kv_bits:
            log.info("quantized KV cache: %s", adapter.check_quantized_kv())
        if self.lockstep.ranks > 1:
            adapter.stop_every = max(1, len(adapter.layers) // STOP_CHECKS_ACROSS_RANKS)
        return adapter, vision

    def _caches(self) -> None:
        """The prefix cache, its disk tier, and the KV memory budget."""
        settings = self.settings
        self.disk_cache = disk_cache.configured(
            settings.prefix_cache_dir,
            settings.prefix_cache_disk_gb,
            self.loaded,
            self._adapter.make_cache,
            self.layout.cuttable,
        )
        sizes = kv_memory.EntrySizes(self.lockstep)
        self.prefix_cache = PrefixCache(
            settings.prefix_cache_mb << 20,
            cuttable=self.layout.cuttable,
            measure=sizes,
            disk=self.disk_cache,
        )
        self.kv_memory = kv_memory.measured(self._adapter, settings, self.lockstep, sizes)
        self.metrics.kv_budget_bytes = self.kv_memory.budget

    def _engine_thread_state(self, banded: bool, vision: VisionJobs | None) -> None:
        """The scheduler, the running sequences and the waiting ones."""
        self.scheduler = Scheduler(self.settings)
        self.decoder = Decoder(
            self._adapter,
            self.layout,
            self.prefix_cache,
            self.metrics,
            banded=banded,
            vocabulary=self.vocabulary,
            speculation=self.speculation,
            lockstep=self.lockstep,
        )
        self.prefill = Prefill(
            self._adapter,
            self.layout,
            self.prefix_cache,
            self.scheduler,
            self.metrics,
            grouped=self.batch_problems.prefill is None,
            cancelled=self._poll_cancelled,
            # Looked up at each call: a router swapped in later (tests wrap it) is the one used.
            ping=lambda stream_id: self.router.ping(stream_id),
            join=self.decoder.join,
            cached=lambda stream_id, tokens, tier: self.router.cached(stream_id, tokens, tier),
            memory=self.kv_memory,
            vision=vision,
        )
        self._heap = heap.Tidier(self.metrics)

    def admit(self, request: GenerationRequest) -> Reader:
        return self.admission.admit(request)

    def busy(self) -> bool:
        return len(self.router) > 0

    def start(self) -> None:
        self.admission.accepting.set()
        self._thread = threading.Thread(target=self._run, name="mlxgate-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self.admission.accepting.clear()
        if self.prefill.vision is not None:
            self.prefill.vision.stop()
        self.admission.notify()
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
        self.admission.accepting.clear()
        self._fail_streams(ErrorKind.INTERNAL, message)

    def _fail_streams(self, kind: ErrorKind, message: str) -> None:
        queued = (*self.admission.held(), *self.prefill.waiting)
        held = [c.stream_id for p in queued for c in p.choices]
        for stream_id in dict.fromkeys([*held, *self.decoder.batch.running_ids]):
            self.router.fail(stream_id, kind, message)

    # --- engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        # MLX streams are per thread: every array the engine evaluates is made on this thread.
        self.decoder.reset()
        leader = self.lockstep.leader
        while True:
            if leader:
                self.admission.wait(self._idle_wait)
            worked = False
            try:
                with self._turn() if self._has_work() else contextlib.nullcontext():
                    plan = self._next_plan()
                    if not plan.running:
                        break
                    worked = self._has_work()
                    self._step(plan)
            except Exception as exc:
                log.exception("engine step failed; failing the affected streams")
                self._fail_all(f"generation failed: {exc}")
                if self.lockstep.ranks > 1:  # the other ranks are somewhere else in the step
                    self.lockstep.failed(f"the engine step failed: {exc}")
                    return
            if worked:
                self._heap.worked(busy=self._has_work())
        self.lockstep.stopped = True

    def _has_work(self) -> bool:
        return bool(len(self.admission) or self.prefill.waiting or len(self.decoder))

    def _idle_wait(self) -> float | None:
        """How long the engine may sleep before its next step: with no work, until a request
        comes (stepping every second all the same); while every prompt waits for its images'
        vision tower and nothing decodes, until a job finishes, stepping every VISION_POLL_S
        (for cancels, which stop the tower, and keep-alives); else not at all."""
        if not self._has_work():
            return 1.0
        if not (len(self.admission) or len(self.decoder)) and self.prefill.blocked_on_vision():
            return VISION_POLL_S
        return None

    def _fail_all(self, message: str) -> None:
        held = self.prefill.clear()
        for stream_id in dict.fromkeys([*self.decoder.batch.running_ids, *held]):
            self.router.fail(stream_id, ErrorKind.INTERNAL, message)
        self.decoder.reset()

    def _step(self, plan: StepPlan) -> None:
        """Run the step's plan: the decode step, then the plan's prefill."""
        self._update_gauges()
        prefill, scheduler, decoder = self.prefill, self.scheduler, self.decoder
        if not (prefill.waiting or len(decoder)):
            return
        started = time.perf_counter()
        decoding = len(decoder)
        if decoding:
            self._gone.update(decoder.step(plan.drafts, self.router))  # dropped as the next starts
            scheduler.decoded(time.perf_counter() - started, plan.drafts)
        if plan.prefill is not None:
            prefill.run(plan.prefill, len(decoder))
        prefill.ping()
        decoder.tidy()
        self.metrics.stepped(time.perf_counter() - started, decoded=bool(decoding))
        self._update_gauges()
        # Once a step: not cheap.
        self.metrics.kv_bytes = decoder.batch.kv_bytes() + prefill.held_bytes()

    def _next_plan(self) -> StepPlan:
        """The next step's plan: rank 0 makes it (its own engine changed as it goes); the other
        ranks are sent it, check their state against rank 0's, and make the same changes."""
        state = self._digest() if self.lockstep.ranks > 1 else []
        plan = self.lockstep.share(lambda: self._plan(state), StepPlan.encode, StepPlan.decode)
        if plan.state != state:
            raise RanksDiverged(
                f"rank {self.lockstep.rank}'s engine state {state} is not rank 0's "
                f"{plan.state}: the ranks no longer run the same schedule"
            )
        if not self.lockstep.leader:
            self._take(plan)
            self.prefill.waiting.extend(self.decoder.preempt(sid) for sid in plan.preempted)
            self.prefill.refresh()
        return plan

    def _plan(self, state: list[int]) -> StepPlan:
        """Rank 0's plan: take the admitted requests in, drop the streams whose clients left or
        stopped reading, keep the KV memory budget; then the guesses to verify and the prefill."""
        started = time.perf_counter()
        plan = StepPlan(
            self.admission.accepting.is_set(),
            self.admission.take(),
            self.router.cancelled(),
            self.router.fail_stalled(self.settings.stall_timeout_s),
            state,
        )
        self._take(plan)
        plan.preempted = self._keep_budget()
        self.prefill.refresh()
        plan.drafts = self._drafts()
        plan.prefill = self._prefill_plan()
        self.metrics.plan_s += time.perf_counter() - started
        return plan

    def _drafts(self) -> Drafts | None:
        speculation, batch = self.speculation, self.decoder.batch
        if speculation is None or not len(batch) or len(batch) > self.settings.speculation_max_rows:
            return None
        return speculation.drafts(batch.stream_ids, self.scheduler.guesses)

    def _prefill_plan(self) -> PrefillPlan | None:
        """The step's prefill, where prompts wait: the room the KV memory budget leaves them is
        what the decode batch and the prompts in prefill do not hold."""
        waiting = self.prefill.waiting
        if not waiting:
            return None
        held = self.decoder.batch.kv_bytes() + self.prefill.held_bytes()
        kv_room = self.kv_memory.budget - held
        return self.scheduler.prefill_plan(len(self.decoder), waiting, kv_room, time.monotonic())

    def _keep_budget(self) -> list[int]:
        """Preempt decoding sequences while the KV memory budget would be outgrown; returns their
        stream ids (each waits again, to resume from its keys/values in the prefix cache)."""
        width = 1 + (self.settings.max_draft_tokens if self.speculation is not None else 0)
        held = self.prefill.held_bytes()
        preempted = self.decoder.keep_budget(self.kv_memory, held, width)
        self.prefill.waiting.extend(preempted)
        return [pending.stream_id for pending in preempted]

    def _poll_cancelled(self) -> set[int]:
        self._gone.update(self.lockstep.share(lambda: self.router.cancelled()))
        return self._gone

    def _take(self, plan: StepPlan) -> None:
        # (With ranks, each rank looks the requests up as the step's prefill is refreshed: at
        # the same point of the schedule.)
        self.prefill.waiting.extend(plan.taken)
        self._gone.update(plan.cancelled)
        self._drop_cancelled()
        for stream_id in plan.stalled:
            log.warning("stream %d: client stopped reading; cancelling its generation", stream_id)
        self.metrics.requests_cancelled += self.decoder.drop(plan.stalled)

    def _digest(self) -> list[int]:
        """What every rank's engine agrees on between steps."""
        batch, waiting = self.decoder.batch, self.prefill.waiting
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
        self.metrics.requests_cancelled += dropped + self.decoder.drop(gone)

    def _update_gauges(self) -> None:
        self.metrics.queue_depth = len(self.prefill.waiting)
        self.metrics.running = len(self.decoder)
