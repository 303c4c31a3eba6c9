"""One declaration per setting: its default, its help and its flag, read by the CLI and the env."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, cast

T = TypeVar("T")
FLAG = "mlxgate.flag"


@dataclass(frozen=True)
class Flag:
    """How a setting appears on the command line. The flag is `--field-name` unless `name` says."""

    help: str
    name: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    default_text: str | None = None  # what the default means, when its value does not say


def setting(
    default: T,
    help: str,
    *,
    name: str | None = None,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    default_text: str | None = None,
) -> T:
    """A settings-dataclass field: `port: int = setting(8080, "port")`."""
    metadata = {FLAG: Flag(help, name, metavar, choices, default_text)}
    if isinstance(default, dict):  # mutable: each instance gets its own copy
        copy = cast(Callable[[], T], lambda: dict(default))
        return cast(T, dataclasses.field(default_factory=copy, metadata=metadata))
    return cast(T, dataclasses.field(default=default, metadata=metadata))


@dataclass(frozen=True)
class Leaf:
    path: str  # dotted through nested settings: "engine.max_queued"
    kind: Any  # the resolved annotation
    flag: Flag


def leaves(cls: type, prefix: str = "") -> Iterator[Leaf]:
    """Every setting of a settings dataclass; a field typed as a dataclass is walked into."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from leaves(cast(type, kind), f"{prefix}{f.name}.")
        elif FLAG in f.metadata:
            yield Leaf(prefix + f.name, kind, f.metadata[FLAG])
        else:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with setting()")


def build(cls: type[T], value: Callable[[str], Any], prefix: str = "") -> T:
    """An instance of `cls` whose setting at each dotted path is `value(path)`."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cast(Any, cls)):
        kind = hints[f.name]
        path = prefix + f.name
        nested = dataclasses.is_dataclass(kind)
        if nested:
            values[f.name] = build(cast(type, kind), value, f"{path}.")
        elif typing.get_origin(kind) is tuple:  # a list in JSON
            values[f.name] = tuple(value(path))
        else:
            values[f.name] = value(path)
    return cls(**values)
