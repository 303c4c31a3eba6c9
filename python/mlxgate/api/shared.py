"""What every API dialect shares: the services it is built with, routes, request parsing,
sampling defaults, rendering and admission."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from mlxgate import chat, logs
from mlxgate._native import Dialect, ErrorKind, Reader
from mlxgate.api.errors import ApiError, invalid
from mlxgate.api.http import Receive, Scope, Send
from mlxgate.api.models import ModelNames
from mlxgate.config import Config
from mlxgate.engine import (
    AdmissionError,
    EngineStopped,
    GenerationRequest,
    Generator,
    Grammar,
    GrammarError,
    PromptTooLong,
    QueueFull,
    SamplingParams,
)

if TYPE_CHECKING:
    from mlxgate.api.resumable import Resumable

Handler = Callable[[Scope, Receive, Send, bytes], Awaitable[None]]
Model = TypeVar("Model", bound=BaseModel)
# How a dialect words each admission error (one table per dialect).
AdmissionErrors = Mapping[type[AdmissionError], Callable[[Any], ApiError]]

# The entries every dialect words alike (each picks its own status for the kind: Anthropic's
# clients retry 529 as "overloaded", OpenAI's 503). A dialect's table adds PromptTooLong.
COMMON_ADMISSION_ERRORS: AdmissionErrors = {
    QueueFull: lambda e: ApiError(
        ErrorKind.OVERLOADED,
        "the server is overloaded: too many requests waiting, retry later",
        retry_after_s=e.retry_after_s,
    ),
    EngineStopped: lambda e: ApiError(ErrorKind.UNAVAILABLE, str(e)),
}


def prompt_too_long(
    error: PromptTooLong, *, code: str | None = None, param: str | None = None
) -> ApiError:
    """A prompt over the context, in the words Claude Code and OpenAI's clients both parse (Claude
    Code reads the two numbers to decide whether to compact; Codex acts on the OpenAI code)."""
    return ApiError(
        ErrorKind.INVALID_REQUEST,
        f"prompt is too long: {error.prompt_tokens} tokens > {error.context_length} maximum",
        should_retry=False,
        code=code,
        param=param,
    )


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # matched as a suffix of the request path (a base-URL prefix is allowed)
    dialect: Dialect
    handler: Handler
    prefix: bool = False  # `path` may be followed by more (e.g. /v1/models/{id})
    # The route is this dialect's only when the request has this header.
    header: bytes | None = None

    def matches(self, path: str) -> bool:
        """Whether `path` is this route's, with or without the `/v1` (clients differ on whether
        the base URL they are given ends with it)."""
        bare = self.path.removeprefix("/v1")
        return bare in path if self.prefix else path.endswith(bare)


def path_tail(scope: Scope, route_path: str) -> str:
    """What follows a prefix route's path (`/v1/models/` -> the model id, which may hold `/`)."""
    return str(scope["path"]).rstrip("/").split(route_path.removeprefix("/v1"), 1)[1]


@dataclass(frozen=True)
class Services:
    """What a dialect is built with: the engine, the model's rendering, names and settings."""

    engine: Generator
    renderer: chat.Renderer
    models: ModelNames
    default_sampling: SamplingParams
    # The server's settings, for the ones only one dialect reads.
    config: Config
    max_output_tokens: int | None = None
    # Where streams go to be resumable (`--resume-window`); None: they are not.
    resumable: Resumable | None = None


def _validation_message(exc: ValidationError) -> str:
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}" if where else first["msg"]


def parse(model: type[Model], body: bytes) -> Model:
    """The request body validated as `model`, or a 400 saying what is wrong."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise invalid(f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise invalid("request body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise invalid(_validation_message(exc)) from None


def sampling(
    defaults: SamplingParams,
    *,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    seed: int | None = None,
    logprobs: int | None = None,
) -> SamplingParams:
    """The request's sampling, the server's defaults where it says nothing."""
    return SamplingParams(
        temperature=defaults.temperature if temperature is None else temperature,
        top_p=defaults.top_p if top_p is None else top_p,
        top_k=defaults.top_k if top_k is None else top_k,
        seed=seed,
        logprobs=logprobs,
    )


def output_limit(services: Services, requested: int | None) -> int | None:
    """The request's output limit under the server's (`--max-output-tokens`): the smaller of
    the two. Clamped, not refused: Claude Code asks for 32k-128k tokens and retries a refusal
    only when the limit is at least a few thousand tokens."""
    limit = services.max_output_tokens
    if limit is None or requested is None:
        return requested if limit is None else limit
    return min(requested, limit)


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


def constraint(prompt: chat.Prompt, reply: Grammar | None) -> Grammar | None:
    """What the engine holds the reply to: a forced call's grammar (arguments valid for the
    tool's schema), else the reply's format (`reply`), else nothing."""
    if prompt.call_grammar is None:
        return reply
    try:
        return Grammar.lark(prompt.call_grammar)
    except GrammarError as exc:
        raise invalid(f"tools: the forced tool's schema cannot be enforced: {exc}") from None


def render(renderer: chat.Renderer, conversation: chat.Conversation) -> chat.Prompt:
    try:
        return renderer.render(conversation)
    except chat.ConversationError as exc:
        raise invalid(str(exc)) from None


def admit(engine: Generator, request: GenerationRequest, errors: AdmissionErrors) -> Reader:
    """Hand `request` to the engine; an admission error answers in the dialect's words."""
    try:
        reader = engine.admit(request)
    except AdmissionError as exc:
        raise errors[type(exc)](exc) from None
    logs.opened(reader)
    return reader
