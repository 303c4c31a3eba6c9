"""The `mlxgate` command line."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import textwrap
import typing
from collections.abc import Sequence
from operator import attrgetter
from types import NoneType, UnionType
from typing import Any

from mlxgate.api.guard import public_bind_refused
from mlxgate.config import Config
from mlxgate.setting import Leaf, build, leaves


def _pair(value: str) -> tuple[str, str]:
    name, _, model = value.partition("=")
    if not name.strip() or not model.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=MODEL, got {value!r}")
    return name.strip(), model.strip()


class _Help(argparse.HelpFormatter):
    """Wraps help text between words only: `--max-step-ratio` stays one piece."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class _Pairs(argparse.Action):
    """A repeatable NAME=VALUE flag filling a dict; a NAME given twice is a usage error."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        name, value = typing.cast(tuple[str, str], values)
        pairs = dict(getattr(namespace, self.dest))  # never the shared default
        if name in pairs:
            raise argparse.ArgumentError(self, f"{name!r} is given twice")
        pairs[name] = value
        setattr(namespace, self.dest, pairs)


class _Items(argparse.Action):
    """A repeatable flag of comma-separated items filling a tuple."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        items = [item.strip() for item in typing.cast(str, values).split(",") if item.strip()]
        setattr(namespace, self.dest, (*getattr(namespace, self.dest), *items))


def _default_text(value: object) -> str:
    if value is False:
        return "off"
    if value is None or value == {} or value == ():
        return "none"
    return str(value)


def _add_flag(group: argparse._ActionsContainer, leaf: Leaf, default: object) -> None:
    flag = leaf.flag
    name = flag.name or "--" + leaf.path.rpartition(".")[2].replace("_", "-")
    shown = flag.default_text or _default_text(default)
    options: dict[str, Any] = {
        "dest": leaf.path,
        "default": default,
        "help": f"{flag.help} (default: {shown})".replace("%", "%%"),
    }
    kind = leaf.kind
    if isinstance(kind, UnionType):  # X | None: None is the default's "not set"
        (kind,) = (arg for arg in typing.get_args(kind) if arg is not NoneType)
    if kind is bool:
        if default is not False:
            raise TypeError(f"{leaf.path}: a flag turns a setting on, so it must default to off")
        options["action"] = "store_true"
    else:
        field_name = leaf.path.rpartition(".")[2]
        options["metavar"] = flag.metavar or (None if flag.choices else field_name.upper())
        options["choices"] = flag.choices
        if typing.get_origin(kind) is dict:
            options.update(action=_Pairs, type=_pair)
        elif typing.get_origin(kind) is tuple:
            options.update(action=_Items, type=str)
        else:
            options["type"] = kind
    group.add_argument(name, **options)


def _add_settings(serve: argparse.ArgumentParser) -> None:
    """A flag per Config setting; a nested dataclass (the engine's) is a group of its own."""
    defaults = Config()
    groups: dict[str, argparse._ActionsContainer] = {"": serve}
    for field in dataclasses.fields(Config):
        value = getattr(defaults, field.name)
        if dataclasses.is_dataclass(value):
            groups[field.name] = serve.add_argument_group(field.name, type(value).__doc__)
    for leaf in leaves(Config):
        group = groups[leaf.path.rpartition(".")[0]]
        _add_flag(group, leaf, attrgetter(leaf.path)(defaults))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxgate", description=__doc__)
    commands = parser.add_subparsers(dest="command")
    serve = commands.add_parser(
        "serve", help="serve a model over the Anthropic and OpenAI APIs", formatter_class=_Help
    )
    _add_settings(serve)
    commands.add_parser(
        "bench",
        help="measure running servers (any of the APIs) into a run directory; see "
        "`mlxgate bench --help`",
        add_help=False,
    )
    return parser


def parse_config(argv: list[str]) -> Config:
    """The settings a command line asks for; exits with a usage error on a bad one."""
    if not argv or argv[0] not in ("serve", "-h", "--help"):
        argv = ["serve", *argv]  # `mlxgate` and `python -m mlxgate` serve by default
    args = _parser().parse_args(argv)
    return build(Config, lambda path: getattr(args, path))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from mlxgate.bench.cli import main as bench

        bench(argv[1:])
        return
    config = parse_config(argv)
    if refused := public_bind_refused(config.host, config.api_key, config.insecure_public):
        sys.exit(f"mlxgate: {refused}")
    from mlxgate import ranks

    ranks.end_with_launcher()
    if config.ranks > 1 and not ranks.launched():
        sys.exit(ranks.launch_local(config.ranks, argv, config.rank_timeout))
    if ranks.launched() and ranks.rank_of_process() != 0:
        from mlxgate import serving

        serving.follow_rank_0(config)
        return
    from mlxgate.server import serve

    serve(config)
