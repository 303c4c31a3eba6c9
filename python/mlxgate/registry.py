"""The served models: every model configured, which are loaded, loading one when a request names
it, and unloading idle ones (after their TTL, or to make room under --max-model-memory).

Each loaded model has an engine of its own (its batch, prefix cache and metrics, on its own
thread); their steps take turns (`Turns`): on a CPU every step already uses every core. State
changes happen on the event loop, so a request that found its model loaded admits to it before
anything can unload it; loading runs on a thread of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import gc
import logging
import os
import re
import threading
import time
import tomllib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from mlxgate.models.vision import VisionPrompts

from mlxgate import chat
from mlxgate._native import ErrorKind
from mlxgate.api.errors import ApiError
from mlxgate.engine import Generator, SamplingParams

log = logging.getLogger("mlxgate")

# Of the machine's memory, the share the models may hold by default (--max-model-memory).
DEFAULT_MEMORY_SHARE = 0.75
# How often idle models are checked against their TTL.
IDLE_CHECK_S = 1.0
# The word --model takes for the embedded model, where no file of that name exists.
EMBEDDED = "embedded"


class State(enum.StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"


@dataclass(frozen=True)
class ModelSpec:
    """One model as configured: `--model NAME=SOURCE`, or a table of `--models-config`."""

    name: str
    source: str | None  # None: the embedded model
    aliases: tuple[str, ...] = ()
    context_length: int | None = None
    rope_scaling: str = "yarn"
    tool_format: str = "auto"
    reasoning_format: str = "auto"
    draft_model: str | None = None
    pinned: bool = False  # loaded at start-up, never unloaded
    ttl_s: float = 0.0  # idle seconds before it is unloaded; 0: it stays
    # Sampling defaults its table sets (SamplingParams' names): above the flags and its own.
    sampling: tuple[tuple[str, float | int], ...] = ()


# The sampling defaults a table of --models-config may set.
SAMPLING_KEYS: dict[str, type | tuple[type, ...]] = {
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": int,
    "repetition_penalty": (int, float),
    "repetition_context_size": int,
    "presence_penalty": (int, float),
    "frequency_penalty": (int, float),
}

# What a table of --models-config may set, and the type each takes.
_TABLE_KEYS: dict[str, type | tuple[type, ...]] = {
    **SAMPLING_KEYS,
    "source": str,
    "aliases": list,
    "context_length": int,
    "rope_scaling": str,
    "tool_format": str,
    "reasoning_format": str,
    "draft_model": str,
    "pinned": bool,
    "ttl": (int, float),
    "default": bool,
}


@dataclass(frozen=True)
class Configured:
    specs: list[ModelSpec]
    default: str  # loaded at start-up and kept; answers a request that names no model
    # A name no model has is answered by the default model (one model, or a default chosen in
    # --models-config), else a 404.
    answers_any_name: bool


def read_specs(
    models: Iterable[str],
    config_file: str | None,
    base: ModelSpec,
    *,
    model_ttl_s: float = 0.0,
    aliases: dict[str, str] | None = None,
) -> Configured:
    """The configured models: each `--model` value (`SOURCE`, or `NAME=SOURCE`), then each table
    of the TOML file (`[models.NAME]`). `base` carries the server-wide settings a model does not
    set itself. With nothing configured: the embedded model. The first model is the default
    unless a table says `default = true`. `aliases` (`--model-alias`): another name -> a
    model's name or its --model value."""
    specs: list[ModelSpec] = []
    chosen: str | None = None
    given: dict[str, str] = {}  # a --model value -> the name it is served under
    for value in models:
        name, source = _name_and_source(value)
        given[value] = given[source or EMBEDDED] = name
        specs.append(_spec(base, name=name, source=source, ttl_s=model_ttl_s))
    if config_file is not None:
        tables, chosen = _read_tables(Path(config_file), base, model_ttl_s)
        specs.extend(tables)
    if not specs:
        specs.append(_spec(base, name=_default_name(None), source=None))
    for alias, target in (aliases or {}).items():
        known = any(spec.name == target for spec in specs)
        found = target if known else given.get(target)
        if found is None:
            served = ", ".join(repr(spec.name) for spec in specs)
            raise ValueError(
                f"--model-alias {alias}={target}: no model is served as {target!r} (served: "
                f"{served}); an alias must name one (--model-alias {alias}={specs[0].name})"
            )
        specs = [
            _spec(s, aliases=(*s.aliases, alias)) if s.name == found and alias != found else s
            for s in specs
        ]
    seen: set[str] = set()
    for name in (name for spec in specs for name in (spec.name, *spec.aliases)):
        if name in seen:
            raise ValueError(f"model name {name!r} is given twice")
        seen.add(name)
    default = chosen or specs[0].name
    specs = [_spec(s, pinned=True) if s.name == default else s for s in specs]
    return Configured(specs, default, answers_any_name=len(specs) == 1 or chosen is not None)


def _name_and_source(value: str) -> tuple[str, str | None]:
    name, equals, source = value.partition("=")
    if not equals:
        name, source = "", value
    source_or_none = None if source == EMBEDDED and not Path(source).exists() else source
    return name.strip() or _default_name(source_or_none), source_or_none


def _default_name(source: str | None) -> str:
    """The name a model is served under when none is given (as /v1/models lists it)."""
    from mlxgate.models import DEFAULT_MODEL

    if source is None:
        return DEFAULT_MODEL
    path = Path(source)
    return path.stem if path.suffix == ".gguf" else source if not path.exists() else path.name


def _spec(base: ModelSpec, **changes: Any) -> ModelSpec:
    return dataclasses.replace(base, **changes)


def _read_tables(path: Path, base: ModelSpec, ttl_s: float) -> tuple[list[ModelSpec], str | None]:
    try:
        document = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"--models-config {path}: {exc}") from None
    tables = document.get("models")
    if not isinstance(tables, dict) or not tables:
        raise ValueError(f"--models-config {path}: no [models.NAME] tables")
    specs, default = [], None
    for name, table in tables.items():
        where = f"--models-config {path}: [models.{name}]"
        if not isinstance(table, dict):
            raise ValueError(f"{where} is not a table")
        for key, value in table.items():
            kind = _TABLE_KEYS.get(key)
            if kind is None:
                raise ValueError(f"{where}: unknown key {key!r} ({', '.join(_TABLE_KEYS)})")
            if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
                raise ValueError(f"{where}: {key} = {value!r} has the wrong type")
        if "source" not in table:
            raise ValueError(f"{where}: no source (a .gguf file, a directory, org/repo, embedded)")
        _, source = _name_and_source(table["source"])
        settings = {key: table[key] for key in _TABLE_KEYS if key in table}
        settings.pop("source")
        sampling = tuple((key, settings.pop(key)) for key in SAMPLING_KEYS if key in settings)
        if settings.pop("default", False):
            default = name
        specs.append(
            _spec(
                base,
                name=name,
                source=source,
                aliases=tuple(settings.pop("aliases", ())),
                ttl_s=float(settings.pop("ttl", ttl_s)),
                sampling=sampling,
                **settings,
            )
        )
    return specs, default


def keep_alive_seconds(value: float | str | None) -> float | None:
    """A request's `keep_alive` (Ollama's): seconds, or a duration such as "5m", "1h30m"; a
    negative one keeps the model loaded until something else unloads it. None: not given."""
    if value is None or isinstance(value, int | float):
        return value
    total, rest = 0.0, value.strip()
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3}
    for amount, unit in re.findall(r"(-?\d+(?:\.\d+)?)(ms|h|m|s)", rest):
        total += float(amount) * units[unit]
    if not re.fullmatch(r"(-?\d+(\.\d+)?(ms|h|m|s))+", rest):
        raise ApiError(
            ErrorKind.INVALID_REQUEST,
            f"keep_alive: {value!r} is not a duration (seconds, or such as 5m, 1h30m, 30s)",
            param="keep_alive",
        )
    return total


@dataclass
class ServedModel:
    """A loaded model: what answering a request needs."""

    name: str
    engine: Generator
    renderer: chat.Renderer
    context_length: int
    weights_bytes: int = 0  # as MLX holds them
    # The engine's KV caches and prefix cache, as MLX holds them (0 for a stand-in engine).
    cache_bytes: Callable[[], int] = lambda: 0
    metrics: Collector | None = None  # what /metrics shows of its engine
    # How its prompts take images (a vision-language model); None: it reads text only.
    vision: VisionPrompts | None = None
    # What a request that leaves a sampling parameter unset gets, and where each came from.
    sampling: SamplingParams = field(default_factory=SamplingParams)
    sampling_sources: dict[str, str] = field(default_factory=dict)

    def footprint(self) -> int:
        return self.weights_bytes + self.cache_bytes()


@dataclass
class ModelEntry:
    spec: ModelSpec
    state: State = State.UNLOADED
    served: ServedModel | None = None
    loading: asyncio.Future[ServedModel] | None = None
    last_used: float = field(default_factory=time.monotonic)
    # A request's keep_alive: unloaded this long after it goes idle (overrides the TTL).
    keep_alive_s: float | None = None
    unload_asked: bool = False  # the unload endpoint asked while it had streams: once idle
    # While loading: what it will hold, as estimated before its load (the budget counts it).
    need: int = 0
    loads: int = 0
    unloads: dict[str, int] = field(default_factory=dict)  # by reason
    load_s: float = 0.0  # the last load's seconds

    @property
    def name(self) -> str:
        return self.spec.name

    def busy(self) -> bool:
        return self.served is not None and self.served.engine.busy()

    def idle_ttl(self) -> float | None:
        """Idle seconds after which it is unloaded; None: it stays."""
        if self.unload_asked:
            return 0.0
        if self.forever():
            return None
        if self.keep_alive_s is not None:
            return self.keep_alive_s
        return self.spec.ttl_s if self.spec.ttl_s > 0 else None

    def forever(self) -> bool:
        """Never unloaded: pinned (the default model is), or a request's negative keep_alive."""
        return self.spec.pinned or (self.keep_alive_s is not None and self.keep_alive_s < 0)


class Turns:
    """Engines' steps one at a time, each engine getting an equal share of the time: of those
    waiting, the one that has computed least goes next (a slow model's long steps do not hold
    a fast one to its pace, as taking turns step by step would). An engine that was idle starts
    level with the least of the others, not owed the time it did not use."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._computing = False
        self._used: dict[str, float] = {}  # seconds each engine has computed
        self._waiting: dict[str, float] = {}  # the engines waiting, by their seconds
        self._level = 0.0  # the least computed by an engine that was waiting or computing

    @contextlib.contextmanager
    def turn(self, engine: str) -> Iterator[None]:
        with self._changed:
            used = self._waiting[engine] = max(self._used.get(engine, 0.0), self._level)
            self._used[engine] = used
            while self._computing or min(self._waiting, key=self._waiting.__getitem__) != engine:
                self._changed.wait()
            del self._waiting[engine]
            self._computing = True
        started = time.perf_counter()
        try:
            yield
        finally:
            with self._changed:
                self._used[engine] += time.perf_counter() - started
                self._level = min([*self._waiting.values(), self._used[engine]])
                self._computing = False
                self._changed.notify_all()


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
            raise ApiError(
                ErrorKind.NOT_FOUND,
                f"model: {requested!r} is not served here; this server answers to "
                + ", ".join(repr(name) for name in self.names),
                code="model_not_found",
                param="model",
                should_retry=False,
            )
        return self.default

    def listed(self, model_id: str) -> ModelEntry:
        """The model `model_id` names (GET /v1/models/{id}), else a 404."""
        entry = self._by_name.get(model_id)
        if entry is None:
            raise ApiError(
                ErrorKind.NOT_FOUND,
                f"model: {model_id!r} is not served here",
                code="model_not_found",
            )
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
                raise ApiError(ErrorKind.UNAVAILABLE, f"model {entry.name!r} is not loaded")
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
        except ApiError:
            raise
        except Exception as exc:
            log.exception("model %s could not be loaded", spec.name)
            raise ApiError(
                ErrorKind.UNAVAILABLE, f"model {spec.name!r} could not be loaded: {exc}"
            ) from None

    def _make_room(self, loading: ModelEntry, need: int) -> list[asyncio.Future[None]]:
        """Unload least recently used idle models until `need` more bytes fit the budget; the
        unloads under way (await them before loading). Raises if they cannot be made to fit."""
        budget = self.memory_budget
        if budget <= 0:
            return []
        if need > budget:
            raise ApiError(
                ErrorKind.INVALID_REQUEST,
                f"model {loading.name!r} needs {_gb(need)} GB, more than the models' memory "
                f"budget of {_gb(budget)} GB (--max-model-memory)",
                should_retry=False,
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
            raise ApiError(
                ErrorKind.OVERLOADED,
                f"model {loading.name!r} needs {_gb(need)} GB; the loaded models "
                f"({', '.join(busy)}) hold {_gb(held)} GB of the {_gb(budget)} GB budget "
                "(--max-model-memory) and are busy or pinned: retry later",
                retry_after_s=5,
            )
        return freed

    def status(self, name: str) -> dict[str, Any]:
        """What /v1/models says of the model `name` names besides its id: its state, and its
        context once known."""
        entry = self._by_name[name]
        served = entry.served
        context = served.context_length if served is not None else entry.spec.context_length
        status: dict[str, Any] = {
            "state": str(entry.state),
            "context_length": context,
            "pinned": entry.forever(),
        }
        if served is not None:
            status["sampling_defaults"] = served.sampling.defaults()
            status["sampling_defaults_from"] = served.sampling_sources
        return status

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


def default_memory_budget() -> int:
    return int(DEFAULT_MEMORY_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
