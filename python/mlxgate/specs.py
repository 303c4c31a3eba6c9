"""The models configured to serve: `--model` values and `--models-config`'s tables, read into
one `ModelSpec` each (the server-wide settings a model does not set itself underneath)."""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The word --model takes for the embedded model, where no file of that name exists.
EMBEDDED = "embedded"


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
