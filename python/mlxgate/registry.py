"""The served models: every model configured (specs.py), which are loaded, loading one when a
request names it, and unloading idle ones (after their TTL, or to make room under
--max-model-memory).

Each loaded model (served.py) has an engine of its own (its batch, prefix cache and metrics, on
its own thread; serving.py makes it). State changes happen on the event loop, so a request that
found its model loaded admits to it before anything can unload it; loading runs on a thread of
its own. What goes wrong is a `ModelError`, in no dialect's words (api/errors.py words it).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterable, Iterator

from mlxgate.served import ModelEntry, ServedModel, State
from mlxgate.specs import ModelSpec

log = logging.getLogger("mlxgate")

# How often idle models are checked against their TTL.
IDLE_CHECK_S = 1.0


class ModelError(Exception):
    """Why the registry cannot give a request its model."""


class UnknownModel(ModelError):
    """No model is served under the name asked for (`served`: the names a request may use, said
    when the name came in a request's body)."""

    def __init__(self, name: str, served: list[str] | None = None) -> None:
        answers = f"; this server answers to {', '.join(map(repr, served))}" if served else ""
        super().__init__(f"model: {name!r} is not served here{answers}")
        self.in_body = served is not None


class ModelUnavailable(ModelError):
    """The model is not loaded and cannot be (a registry of loaded models, or its load failed)."""


class ModelTooLarge(ModelError):
    """The model needs more memory than the models' whole budget."""


class NoRoom(ModelError):
    """The loaded models are busy or pinned, so the model does not fit now: retry later."""

    retry_after_s = 5


class ModelRegistry:
    """Every configured model by name and alias; requests find theirs with `find`, and
    `ready` loads it if it is not loaded."""

    def __init__(
        self,
        specs: list[ModelSpec],
        default: str,
        load: Callable[[ModelSpec], ServedModel] | None,
        *,
        answers_any_name: bool = True,
        memory_budget: int = 0,
        estimate: Callable[[ModelSpec], int] = lambda spec: 0,
    ) -> None:
        """`load` builds a model's ServedModel (on a loading thread); None: nothing loads (every
        model is given loaded). `default` answers a name no model has if `answers_any_name`.
        `memory_budget`: bytes the loaded models may hold (0: no limit); `estimate`: what a
        model will hold once loaded, before it is."""
        self.entries = {spec.name: ModelEntry(spec) for spec in specs}
        self._by_name = {
            name: entry
            for entry in self.entries.values()
            for name in (entry.name, *entry.spec.aliases)
        }
        self.default = self.entries[default]
        self.answers_any_name = answers_any_name
        self._load = load
        self.memory_budget = memory_budget
        self._estimate = estimate
        self.created = int(time.time())
        self._idle_task: asyncio.Task[None] | None = None

    @classmethod
    def serving(
        cls, served: ServedModel, *, aliases: Iterable[str] = (), answers_any_name: bool = True
    ) -> ModelRegistry:
        """A registry of one model, loaded already (stand-in engines, benchmarks)."""
        spec = ModelSpec(served.name, None, tuple(aliases), pinned=True)
        registry = cls([spec], served.name, None, answers_any_name=answers_any_name)
        registry.default.served, registry.default.state = served, State.LOADED
        return registry

    @property
    def names(self) -> list[str]:
        """Every name a request may use: each model's, then its aliases."""
        return [
            name for entry in self.entries.values() for name in (entry.name, *entry.spec.aliases)
        ]

    def find(self, requested: str | None) -> ModelEntry:
        """The model a request names; no name, or (`answers_any_name`) a name no model has, is
        the default model; else a 404."""
        if requested is None:
            return self.default
        entry = self._by_name.get(requested)
        if entry is not None:
            return entry
        if not self.answers_any_name:
            raise UnknownModel(requested, self.names)
        return self.default

    def listed(self, model_id: str) -> ModelEntry:
        """The model `model_id` names (GET /v1/models/{id}), else a 404."""
        entry = self._by_name.get(model_id)
        if entry is None:
            raise UnknownModel(model_id)
        return entry

    # --- loading and unloading (on the event loop) ---------------------------------------

    async def ready(self, entry: ModelEntry, keep_alive_s: float | None = None) -> ServedModel:
        """`entry`'s loaded model, loading it first if it is not (others unloaded to make room
        if they must be). `keep_alive_s`: the request's keep_alive."""
        if keep_alive_s is not None:
            entry.keep_alive_s = keep_alive_s
        entry.last_used = time.monotonic()
        self._watch_idle()
        while entry.served is None:
            if entry.loading is None:
                entry.loading = asyncio.ensure_future(self._load_entry(entry))
            await asyncio.shield(entry.loading)
        return entry.served

    async def _load_entry(self, entry: ModelEntry) -> ServedModel:
        loop = asyncio.get_running_loop()
        try:
            if self._load is None:
                raise ModelUnavailable(f"model {entry.name!r} is not loaded")
            entry.state = State.LOADING
            started = time.monotonic()
            # (On a thread: estimating a GGUF's size converts it first.)
            entry.need = await loop.run_in_executor(None, self._estimate, entry.spec)
            freed = self._make_room(entry, entry.need)
            for unloading in freed:
                await unloading
            served = await loop.run_in_executor(None, self._load_logged, entry.spec)
            entry.load_s = time.monotonic() - started
            entry.served, entry.state = served, State.LOADED
            entry.loads += 1
            entry.last_used = time.monotonic()
            return served
        except BaseException:
            entry.state = State.UNLOADED
            raise
        finally:
            entry.loading = None

    def _load_logged(self, spec: ModelSpec) -> ServedModel:
        assert self._load is not None
        try:
            return self._load(spec)
        except ModelError:
            raise
        except Exception as exc:
            log.exception("model %s could not be loaded", spec.name)
            raise ModelUnavailable(f"model {spec.name!r} could not be loaded: {exc}") from None

    def _make_room(self, loading: ModelEntry, need: int) -> list[asyncio.Future[None]]:
        """Unload least recently used idle models until `need` more bytes fit the budget; the
        unloads under way (await them before loading). Raises if they cannot be made to fit."""
        budget = self.memory_budget
        if budget <= 0:
            return []
        if need > budget:
            raise ModelTooLarge(
                f"model {loading.name!r} needs {_gb(need)} GB, more than the models' memory "
                f"budget of {_gb(budget)} GB (--max-model-memory)"
            )
        held = sum(self._holds(entry) for entry in self.entries.values() if entry is not loading)
        freed = []
        idle = sorted(
            (
                e
                for e in self.entries.values()
                if e.served is not None and not e.forever() and not e.busy()
            ),
            key=lambda e: e.last_used,
        )
        while held + need > budget and idle:
            entry = idle.pop(0)
            held -= self._holds(entry)
            log.info(
                "unloading model %s to make room for %s (--max-model-memory)",
                entry.name,
                loading.name,
            )
            freed.append(self.unload(entry, "memory"))
        if held + need > budget:
            busy = [e.name for e in self.loaded() if e is not loading]
            raise NoRoom(
                f"model {loading.name!r} needs {_gb(need)} GB; the loaded models "
                f"({', '.join(busy)}) hold {_gb(held)} GB of the {_gb(budget)} GB budget "
                "(--max-model-memory) and are busy or pinned: retry later"
            )
        return freed

    def _holds(self, entry: ModelEntry) -> int:
        if entry.served is not None:
            return entry.served.footprint()
        return entry.need if entry.state is State.LOADING else 0

    def unload(self, entry: ModelEntry, reason: str) -> asyncio.Future[None]:
        """Take `entry` out of service now and stop its engine on a thread; the future is done
        when its memory is back."""
        served, entry.served, entry.state = entry.served, None, State.UNLOADED
        entry.keep_alive_s, entry.unload_asked = None, False
        entry.unloads[reason] = entry.unloads.get(reason, 0) + 1
        loop = asyncio.get_running_loop()
        if served is None:
            done: asyncio.Future[None] = loop.create_future()
            done.set_result(None)
            return done
        log.info("model %s unloaded (%s)", entry.name, reason)
        return loop.run_in_executor(None, _release, [served])

    def unload_when_idle(self, entry: ModelEntry) -> asyncio.Future[None] | None:
        """What the unload endpoint asks: unload `entry` now (the future: its memory is back),
        or, while it has streams (None), as soon as they end, pinned or not."""
        if not entry.busy():
            return self.unload(entry, "request")
        entry.unload_asked = True
        self._watch_idle()
        return None

    def _watch_idle(self) -> None:
        watching = self._idle_task is not None and not self._idle_task.done()
        unloadable = (e for e in self.entries.values() if not e.forever() or e.unload_asked)
        if not watching and any(unloadable):
            self._idle_task = asyncio.ensure_future(self._unload_idle())

    async def _unload_idle(self) -> None:
        while True:
            await asyncio.sleep(IDLE_CHECK_S)
            now = time.monotonic()
            for entry in self.entries.values():
                if entry.served is None:
                    continue
                if entry.busy():
                    entry.last_used = now
                    continue
                ttl = entry.idle_ttl()
                if ttl is not None and now - entry.last_used >= ttl:
                    await self.unload(entry, "request" if entry.unload_asked else "idle")

    def stop(self) -> None:
        """Stop every engine (the server is going away). Any thread: the drain calls it from
        an executor's."""
        if (task := self._idle_task) is not None:
            with contextlib.suppress(RuntimeError):  # (its loop has closed: nothing to cancel)
                task.get_loop().call_soon_threadsafe(task.cancel)
        for entry in self.entries.values():
            if entry.served is not None:
                entry.served.engine.stop()

    def load_pinned(self) -> None:
        """Load the default model and the pinned ones now, on this thread (start-up)."""
        for entry in self.entries.values():
            if entry is self.default or entry.spec.pinned:
                assert self._load is not None
                started = time.monotonic()
                entry.served, entry.state = self._load(entry.spec), State.LOADED
                entry.load_s, entry.loads = time.monotonic() - started, 1

    def loaded(self) -> Iterator[ModelEntry]:
        return (entry for entry in self.entries.values() if entry.served is not None)


def _release(holder: list[ServedModel]) -> None:
    """Stop the engine and give its memory back (weights, caches, MLX's buffer cache). (In a
    list: the executor holds its call's arguments until the call returns.)"""
    import mlx.core as mx

    served = holder.pop()
    served.engine.stop()
    del served
    gc.collect()
    mx.clear_cache()


def _gb(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f}"
