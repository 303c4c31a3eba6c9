"""A server under test, as `mlxgate bench --target` names it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from mlxgate.bench.records import DIALECTS


@dataclass(frozen=True)
class Target:
    """A server under test: `NAME=URL[,dialect=anthropic|openai|responses][,pid=PID]
    [,model=M][,trace=chat]`; with the pid, its CPU time is read from /proc; with `trace=chat`
    an agent trace's turns go to it as chat completions (it speaks no other API)."""

    name: str
    url: str
    dialect: str = "openai"
    pid: int | None = None
    model: str = "default_model"
    trace_as_chat: bool = False

    @classmethod
    def parse(cls, text: str) -> Target:
        name, sep, rest = text.partition("=")
        url, *options = rest.split(",")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"a target is NAME=URL[,dialect=...][,pid=...], not {text!r}")
        target = cls(name, url.rstrip("/"))
        for option in options:
            key, _, value = option.partition("=")
            if key == "dialect" and value in DIALECTS:
                target = replace(target, dialect=value)
            elif key == "pid" and value.isdigit():
                target = replace(target, pid=int(value))
            elif key == "model" and value:
                target = replace(target, model=value)
            elif key == "trace" and value in ("chat", "recorded"):
                target = replace(target, trace_as_chat=value == "chat")
            else:
                raise ValueError(f"{text!r}: unknown target option {option!r}")
        return target
