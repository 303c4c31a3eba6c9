"""One request's way through the server, whatever its dialect: parse, find the model (loading
it if it must), render, hold to a grammar, admit, respond. A dialect supplies only what differs:
its request model and conversion, its stream's parameters (`StreamSpec`) and its admission
table."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from mlxgate import prompts
from mlxgate._native import Dialect, ErrorKind, Reader, Reply, StreamSpec
from mlxgate.api.delivery import respond
from mlxgate.api.errors import ApiError, invalid
from mlxgate.api.http import (
    MODEL,
    MODEL_WAIT,
    READER,
    Receive,
    Scope,
    Send,
    start_event_stream,
)
from mlxgate.api.images import load_images, marked
from mlxgate.api.requests import keep_alive_seconds, loop_guarded
from mlxgate.config import Config
from mlxgate.engine import (
    AdmissionError,
    EngineStopped,
    GenerationRequest,
    Grammar,
    GrammarError,
    PromptTooLong,
    QueueFull,
    SamplingParams,
)
from mlxgate.registry import ModelRegistry
from mlxgate.served import ServedModel

if TYPE_CHECKING:
    from mlxgate.api.resumable import Resumable

# What a streamed response gets while its model loads: an SSE comment, before any event (a
# comment after one would make the openai SDK's decoder dispatch an empty event).
PING = b": loading the model\n\n"

# A dialect's StreamSpec for a rendered prompt's reply and the name of the model answering.
SpecFor = Callable[[Reply, str], StreamSpec]

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
    held = " (what the KV cache's memory budget holds, --kv-memory-gb)" if error.memory else ""
    return ApiError(
        ErrorKind.INVALID_REQUEST,
        f"prompt is too long: {error.prompt_tokens} tokens > {error.context_length} maximum{held}",
        should_retry=False,
        code=code,
        param=param,
    )


@dataclass(frozen=True)
class Services:
    """What a dialect is built with: the served models and the settings."""

    models: ModelRegistry
    # The server's settings, for the ones only one dialect reads.
    config: Config
    max_output_tokens: int | None = None
    # Where streams go to be resumable (`--resume-window`); None: they are not.
    resumable: Resumable | None = None


def output_limit(services: Services, requested: int | None) -> int | None:
    """The request's output limit under the server's (`--max-output-tokens`): the smaller of
    the two. Clamped, not refused: Claude Code asks for 32k-128k tokens and retries a refusal
    only when the limit is at least a few thousand tokens."""
    limit = services.max_output_tokens
    if limit is None or requested is None:
        return requested if limit is None else limit
    return min(requested, limit)


def constraint(prompt: prompts.Prompt, reply: Grammar | None) -> Grammar | None:
    """What the engine holds the reply to: a forced call's grammar (arguments valid for the
    tool's schema), else the reply's format (`reply`), else nothing."""
    if prompt.call_grammar is None:
        return reply
    try:
        return Grammar.lark(prompt.call_grammar)
    except GrammarError as exc:
        raise invalid(f"tools: the forced tool's schema cannot be enforced: {exc}") from None


class Named(Protocol):
    """What every dialect's request says of its model."""

    @property
    def model(self) -> str | None: ...
    @property
    def keep_alive(self) -> float | str | None:
        """How long its model stays loaded once idle (Ollama's keep_alive); None: its TTL."""
        ...


class Asked(Named, Protocol):
    """What every dialect's generation request says besides its prompt."""

    @property
    def stream(self) -> bool: ...
    @property
    def speculative_decoding(self) -> bool: ...
    @property
    def temperature(self) -> float | None: ...
    @property
    def loop_guard(self) -> bool | None: ...

    def output_tokens(self) -> int | None:
        """The most tokens the reply may have, as asked; None: as many as fit."""
        ...

    def sampling(self, defaults: SamplingParams) -> SamplingParams: ...

    def grammar(self) -> Grammar | None:
        """What the reply's format says it must match."""
        ...


class Pipeline:
    """A dialect's way to the engine: `answer` takes a parsed request to its response."""

    def __init__(self, services: Services, dialect: Dialect, errors: AdmissionErrors) -> None:
        self.services = services
        self.dialect = dialect
        self.errors = errors

    async def model(self, scope: Scope, send: Send, request: Asked) -> ServedModel:
        """The model `request` names, loaded: a 404 for a name no model has (unless the default
        model answers any), and one not loaded is loaded first. A streamed response starts
        meanwhile and gets an SSE comment every ping interval, so that nothing between the
        client and the server gives up on it."""
        registry = self.services.models
        entry = registry.find(request.model)  # (both checked before any answer starts)
        ready = registry.ready(entry, keep_alive_seconds(request.keep_alive))
        if entry.served is not None:
            served = await ready
        else:
            started = time.monotonic()
            served = await (self._pinging(scope, send, ready) if request.stream else ready)
            scope[MODEL_WAIT] = time.monotonic() - started
        scope[MODEL] = served.name  # for the request log
        return served

    async def loaded(self, request: Named) -> ServedModel:
        """The model `request` names, loaded (this waits while it loads)."""
        registry = self.services.models
        keep_alive = keep_alive_seconds(request.keep_alive)
        return await registry.ready(registry.find(request.model), keep_alive)

    async def _pinging(
        self, scope: Scope, send: Send, ready: Awaitable[ServedModel]
    ) -> ServedModel:
        loading = asyncio.ensure_future(ready)
        try:
            await start_event_stream(send, scope)
            interval = self.services.config.engine.ping_interval_s
            while not (await asyncio.wait([loading], timeout=interval))[0]:
                await send({"type": "http.response.body", "body": PING, "more_body": True})
            return loading.result()
        finally:
            loading.cancel()  # (the load itself goes on: `ready` shields it)

    async def answer(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        served: ServedModel,
        request: Asked,
        prompt: prompts.Conversation | str,
        spec: SpecFor,
        *,
        choices: int = 1,
    ) -> Reader:
        """Generate the answer to `request` with `served` and respond with it (see `admit`).
        Returns the reader (the response has been sent when this returns)."""
        reader = await self.admit(served, request, prompt, spec, choices=choices)
        scope[READER] = reader  # for the request log
        await respond(
            scope,
            send,
            receive,
            reader,
            self.dialect,
            stream=request.stream,
            resumable=self.services.resumable,
        )
        return reader

    async def admit(
        self,
        served: ServedModel,
        request: Asked,
        prompt: prompts.Conversation | str,
        spec: SpecFor,
        *,
        choices: int = 1,
    ) -> Reader:
        """Start generating the answer to `request` with `served`: `prompt` rendered (a
        conversation through the chat template, text as it is), `spec` made from the prompt's
        `Reply`. Returns its reader at once."""
        services = self.services
        grammar = request.grammar()
        rendered = await self.prompt(served, prompt)
        generation = GenerationRequest(
            rendered.ids,
            spec(rendered.reply, served.name),
            max_tokens=output_limit(services, request.output_tokens()),
            sampling=request.sampling(served.sampling),
            grammar=constraint(rendered, grammar),
            speculate=request.speculative_decoding,
            choices=choices,
            images=rendered.images,
            loop_guard=loop_guarded(request.loop_guard, request.temperature),
        )
        try:
            return served.engine.admit(generation)
        except AdmissionError as exc:
            raise self.errors[type(exc)](exc) from None

    async def prompt(
        self, served: ServedModel, prompt: prompts.Conversation | str
    ) -> prompts.Prompt:
        """`prompt` rendered for `served`, its images (if any) loaded and made into the model's
        image tokens (on a worker thread)."""
        if isinstance(prompt, prompts.Conversation) and prompt.images:
            prompt = marked(prompt)  # (the edits of its context may have left fewer)
        if not (isinstance(prompt, prompts.Conversation) and prompt.images):
            return self.render(served, prompt)
        if served.vision is None:  # (refused before any rendering)
            raise invalid(
                f"the model {served.name!r} reads text only: it cannot take images "
                "(serve a vision-language model for them)"
            )
        rendered = self.render(served, prompt)
        loaded = await load_images(prompt.images, self.services.config)
        try:
            return await asyncio.to_thread(served.vision.prompt, rendered, loaded)
        except prompts.ConversationError as exc:
            raise invalid(str(exc)) from None

    def render(self, served: ServedModel, prompt: prompts.Conversation | str) -> prompts.Prompt:
        """`prompt` rendered as text (a conversation's images still marks in it)."""
        renderer = served.renderer
        if isinstance(prompt, str):
            rendered = renderer.plain(prompt)
            if len(rendered.ids) < 2:  # the engine decodes from the last token after the rest
                raise invalid(
                    f"prompt: must be at least 2 tokens long; this one is {len(rendered.ids)}",
                    param="prompt",
                )
            return rendered
        try:
            return renderer.render(prompt)
        except prompts.ConversationError as exc:
            raise invalid(str(exc)) from None
