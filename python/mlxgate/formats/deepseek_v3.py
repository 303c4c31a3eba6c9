"""DeepSeek V3.1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}
<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>` (V3.2's DSML markup is another format, not this one)."""

# ruff: noqa: RUF001, RUF002 (DeepSeek's tags are written with fullwidth bars)

from __future__ import annotations

import json
from typing import Any

from mlxgate.formats.common import unchanged as prepare

__all__ = ["NAME", "detect", "forced_opening", "prepare", "render_call"]

NAME = "deepseek_v3"
CALLS, CALL, SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"


def detect(template: str) -> bool:
    return CALLS in template and SEP in template and "DSML" not in template


def render_call(name: str, arguments: dict[str, Any]) -> str:
    body = json.dumps(arguments, ensure_ascii=False)
    return f"{CALLS}{CALL}{name}{SEP}{body}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"


def forced_opening(name: str | None) -> str:
    return f"{CALLS}{CALL}{name}{SEP}" if name else f"{CALLS}{CALL}"
