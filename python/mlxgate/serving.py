"""Serving a model: the models a server's settings configure, each loaded (weights, tokenizer,
renderer, draft model) and given a running engine (`serve_model`), the registry that holds them,
the engines' shared CPU time (`Turns`), a served model's sampling defaults. The app (app.py)
serves through here; so does each rank of a model across processes (`serve_model` on rank 0,
`follow_rank_0` on the others; ranks.py has the group itself).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from mlxgate import prompts, ranks
from mlxgate._native import Router
from mlxgate.api.vision_prompts import VisionPrompts
from mlxgate.config import Config
from mlxgate.engine import Engine, SamplingParams
from mlxgate.engine.drafter import check_vocabularies
from mlxgate.engine.lockstep import RankGroup
from mlxgate.metrics import EngineCollector
from mlxgate.registry import ModelRegistry
from mlxgate.served import ServedModel
from mlxgate.specs import Configured, ModelSpec, read_specs

if TYPE_CHECKING:
    import mlx.nn as nn

    from mlxgate.models import LoadedModel

log = logging.getLogger("mlxgate")

# Of the machine's memory, the share the models may hold by default (--max-model-memory).
DEFAULT_MEMORY_SHARE = 0.75


def configured(config: Config) -> Configured:
    """The models `config` serves (--model, --models-config, --model-alias)."""
    base = ModelSpec(
        name="",
        source=None,
        context_length=config.context_length,
        rope_scaling=config.rope_scaling,
        tool_format=config.tool_format,
        reasoning_format=config.reasoning_format,
        draft_model=config.draft_model,
    )
    return read_specs(
        config.model,
        config.models_config,
        base,
        model_ttl_s=config.model_ttl,
        aliases=config.model_aliases,
    )


def registry(config: Config) -> ModelRegistry:
    """Every model `config` configures, the default one (and any pinned) loaded and serving."""
    from mlxgate import models

    if ranks.launched():
        ranks.check_config(config)
    chosen = configured(config)
    # On a CPU every step uses every core: several models' engines take turns.
    turns = Turns() if len(chosen.specs) > 1 else None
    served = ModelRegistry(
        chosen.specs,
        chosen.default,
        lambda spec: serve_model(spec, config, turns),
        answers_any_name=chosen.answers_any_name and not config.strict_models,
        memory_budget=int(config.max_model_memory * 2**30) or _default_memory_budget(),
        estimate=lambda spec: models.stored_bytes(spec.source),
    )
    served.load_pinned()
    return served


def load_model(
    spec: ModelSpec, config: Config, shard: Callable[[nn.Module], None] | None = None
) -> LoadedModel:
    """`spec`'s model as `config` serves it (`shard`: this rank's part of it, ranks.py)."""
    from mlxgate import models

    return models.load(
        spec.source,
        trust_remote_code=config.trust_remote_code,
        context_length=spec.context_length,
        rope_scaling=spec.rope_scaling,
        weights=config.weights,
        cpu_kernels=not config.no_cpu_kernels,
        int8_activations=config.int8_activations,
        shard=shard,
    )


def serve_model(spec: ModelSpec, config: Config, turns: Turns | None = None) -> ServedModel:
    """Load `spec`'s model (and its draft model) and start its engine; launched as rank 0 of
    several, its shard and the engine that leads the others (ranks.py)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxgate import models
    from mlxgate.models.cpu import int8

    started = time.monotonic()
    group = ranks.group()
    lockstep = RankGroup(group) if group is not None else None
    loaded = load_model(spec, config, ranks.sharder(group, config.pipeline) if group else None)
    tokenizer = loaded.tokenizer
    vocab = tokenizer.native_vocab()
    renderer = prompts.Renderer(
        tokenizer,
        tool_format=None if spec.tool_format == "auto" else spec.tool_format,
        reasoning_format=None if spec.reasoning_format == "auto" else spec.reasoning_format,
    )
    draft = None
    if spec.draft_model is not None:
        # At the served model's context, so that its guesses reach as far.
        draft_spec = dataclasses.replace(
            spec, source=spec.draft_model, context_length=loaded.context_length
        )
        draft = load_model(draft_spec, config)
        check_vocabularies(tokenizer.token_strings(), draft.tokenizer.token_strings())
        log.info(
            "draft model %s: %s, %s",
            draft.name,
            models.architecture(draft.model),
            models.precision(draft.model),
        )
    sampling, sampling_sources = SamplingParams.layered(sampling_layers(spec, config, loaded))
    if loaded.vision is not None and turns is None:
        turns = Turns()  # its vision tower's blocks and its engine's steps take turns
    turn = functools.partial(turns.turn, spec.name) if turns else contextlib.nullcontext
    vision_turn = (
        functools.partial(turns.turn, f"{spec.name} (vision)") if turns else contextlib.nullcontext
    )
    with turn():  # its start-up checks run the model: between the other engines' steps
        engine = Engine(
            loaded,
            Router(vocab),
            config.engine,
            end_ids=renderer.eos_ids,
            draft_model=draft.model if draft else None,
            turn=turn,
            vision_turn=vision_turn,
            lockstep=lockstep,
        )
    if lockstep is not None:
        lockstep.on_failure = functools.partial(ranks.leader_failed, engine)
        ranks.watch(lockstep, config.rank_timeout)
    layout = engine.layout
    weights: list[tuple[str, mx.array]] = [
        named  # type: ignore[misc]
        for model in (loaded.model, draft.model if draft else None)
        if model is not None
        for named in tree_flatten(model.parameters())
    ]
    engine.start()
    log.info(
        "model %s: %s, %s, %s, context %s, takes %s, tool calls %s, reasoning %s, kernels: %s "
        "(%s); the prefix cache reuses %s; sampling defaults: %s; loaded in %.1fs",
        spec.name,
        models.architecture(loaded.model),
        layout.describe(),
        models.precision(loaded.model),
        loaded.describe_context(),
        loaded.vision.describe() if loaded.vision is not None else "text",
        _chosen(renderer.format.tool_format.NAME, spec.tool_format),
        _chosen(renderer.format.reasoning.name, spec.reasoning_format),
        loaded.kernels,
        loaded.source,
        layout.reuse(),
        described_sampling(sampling, sampling_sources),
        time.monotonic() - started,
    )
    if loaded.blocks is not None:
        log.info("model %s: GGUF blocks %s", spec.name, loaded.blocks)
    return ServedModel(
        spec.name,
        engine,
        renderer,
        loaded.context_length,
        weights_bytes=sum(array.nbytes for _, array in weights) + int8.nbytes(loaded.model),
        cache_bytes=lambda: engine.metrics.kv_bytes + engine.prefix_cache.nbytes,
        metrics=EngineCollector(engine),
        vision=VisionPrompts(loaded.vision) if loaded.vision is not None else None,
        sampling=sampling,
        sampling_sources=sampling_sources,
    )


# The flags that set sampling defaults (SamplingParams' names).
SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "repetition_penalty", "repetition_context_size")


def sampling_layers(
    spec: ModelSpec, config: Config, loaded: LoadedModel
) -> list[tuple[str, dict[str, float]]]:
    """Where a served model's sampling defaults come from, first to last: its --models-config
    table, the flags given, then (unless --sampling-defaults server) the model's own."""
    flags = {name: getattr(config, name) for name in SAMPLING_FLAGS}
    layers = [
        ("--models-config", dict(spec.sampling)),
        ("the flags", {name: value for name, value in flags.items() if value is not None}),
    ]
    if config.sampling_defaults == "model":
        layers.append((loaded.sampling_source, dict(loaded.sampling)))
    return layers


def described_sampling(sampling: SamplingParams, sources: dict[str, str]) -> str:
    """The defaults a model samples with, for the start-up line: "temperature 0.2, ... (from
    where)", or greedy."""
    if not sources:
        return "greedy (mlxgate's own)"
    by_source: dict[str, list[str]] = {}
    for name, source in sources.items():
        by_source.setdefault(source, []).append(f"{name} {getattr(sampling, name)}")
    return "; ".join(f"{', '.join(values)} ({source})" for source, values in by_source.items())


def _chosen(name: str, setting: str) -> str:
    return f"{name} ({'detected' if setting == 'auto' else 'set'})"


def follow_rank_0(config: Config) -> None:
    """A rank other than 0 (ranks.py): load its shard, then run the engine as rank 0 says,
    until it stops. Exits non-zero if the group fails."""
    from mlxgate import logs

    logs.configure(config.log_level, config.log_format)
    # Rank 0 leads a shutdown (it drains, then its engine stops every rank's).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    joined = ranks.group()
    assert joined is not None
    rank = joined.rank()
    try:
        ranks.check_config(config)
        chosen = configured(config)
        spec = next(spec for spec in chosen.specs if spec.name == chosen.default)
        loaded = load_model(spec, config, ranks.sharder(joined, config.pipeline))
    except Exception as exc:
        sys.exit(f"mlxgate rank {rank}: cannot load its shard: {exc}")
    lockstep = RankGroup(joined)
    lockstep.on_failure = lambda message: ranks.exit_failed(f"rank {rank}: {message}")
    engine = Engine(loaded, ranks.SilentRouter(), config.engine, lockstep=lockstep)  # type: ignore[arg-type]
    log.info("rank %d of %d: %s, following rank 0", rank, joined.size(), loaded.describe_context())
    ranks.watch(lockstep, config.rank_timeout)
    engine.start()
    engine.wait()
    engine.stop()
    log.info("rank %d: rank 0 stopped; exiting", rank)
    # Not through the interpreter's exit: it would destroy MLX's ring group with its threads
    # still joinable, and C++ aborts the process (exit -6, "terminate called without an
    # active exception") when rank 0 has gone first.
    logging.shutdown()
    os._exit(0)


def _default_memory_budget() -> int:
    return int(DEFAULT_MEMORY_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


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
