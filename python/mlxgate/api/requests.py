"""What the dialects' request models share: a body parsed into one, the served model's sampling
defaults under it, the loop guard's default, a reply format's grammar, a keep_alive duration."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from mlxgate._native import ErrorKind
from mlxgate.api.errors import ApiError, invalid
from mlxgate.engine import Grammar, GrammarError, SamplingParams

Model = TypeVar("Model", bound=BaseModel)


def _validation_message(exc: ValidationError) -> str:
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}" if where else first["msg"]


def json_object(body: bytes | str, what: str = "request body") -> dict[str, Any]:
    """`body` parsed as a JSON object, or a 400 saying what is wrong with `what`."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise invalid(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise invalid(f"{what} must be a JSON object")
    return payload


def parse(model: type[Model], body: bytes) -> Model:
    """The request body validated as `model`, or a 400 saying what is wrong."""
    return validate(model, json_object(body))


def validate(model: type[Model], payload: dict[str, Any]) -> Model:
    """A JSON object validated as `model`, or a 400 saying what is wrong."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise invalid(_validation_message(exc)) from None


def sampling(
    defaults: SamplingParams,
    *,
    seed: int | None = None,
    logprobs: int | None = None,
    **given: Any,
) -> SamplingParams:
    """The request's sampling: what it `given` (SamplingParams' names; None where it says
    nothing), the served model's defaults for the rest."""
    chosen = {name: value for name, value in given.items() if value is not None}
    return dataclasses.replace(defaults, seed=seed, logprobs=logprobs, **chosen)


def loop_guarded(asked: bool | None, temperature: float | None) -> bool:
    """Whether a reply gets the loop guard: as the request asks (mlxgate's own `loop_guard`),
    else unless it chose greedy decoding itself (`temperature: 0`: exact tokens, as asked)."""
    return asked if asked is not None else temperature != 0.0


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


def reply_grammar(kind: str, schema: dict[str, Any] | None, param: str) -> Grammar | None:
    """What a reply in `kind` ("text", "json_object", "json_schema") must match: any JSON object,
    the schema's JSON (`strict` or not: enforced either way), or nothing; a schema the engine
    cannot enforce is a 400 naming what in it."""
    if kind == "text":
        return None
    if kind == "json_schema" and schema is None:
        raise invalid(f"{param}: a json_schema format needs its schema", param=param)
    try:
        return Grammar.json_schema(schema)
    except GrammarError as exc:
        raise invalid(f"{param}: {exc}", param=param) from None
