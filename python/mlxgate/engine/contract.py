"""The contract between the API and the engine: what a request asks for, what admission refuses.

The API renders the prompt and builds the request's `StreamSpec` (its dialect, stop sequences,
markup and end-of-turn tokens: everything that decides how the stream reads and when it ends);
the engine admits it and schedules token ids. Admission errors carry no HTTP status and no
dialect's words: each API dialect maps them in its own table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

from mlxgate._native import Reader, StreamSpec
from mlxgate.engine.constraints import Grammar


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    # Report each token's log-probability and this many likeliest alternatives (0-20), from the
    # logits the token was sampled from (after temperature and any grammar, before top-k/top-p).
    # None: nothing is computed.
    logprobs: int | None = None
    # mlx-lm's penalties (engine/penalties.py), each over the last `*_context_size` tokens (of
    # the prompt and reply for repetition, of the reply for presence and frequency); 0 is off.
    # Repetition divides a seen token's positive logit by the penalty (1 changes nothing);
    # presence and frequency subtract from it, once or per time.
    repetition_penalty: float = 0.0
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @classmethod
    def layered(
        cls, layers: Sequence[tuple[str, Mapping[str, float]]]
    ) -> tuple[SamplingParams, dict[str, str]]:
        """Defaults made of `layers` (where they come from, what they set), first to last: the
        first layer that sets a field gives it, mlxgate's own default the rest. Returns them and
        where each set one came from; a value out of range is a ValueError naming its layer."""
        chosen: dict[str, float] = {}
        sources: dict[str, str] = {}
        for source, values in layers:
            for name, value in values.items():
                if name in chosen:
                    continue
                if not _IN_RANGE[name](value):
                    raise ValueError(f"{source}: {name} = {value} is out of range")
                chosen[name], sources[name] = value, source
        return cls(**chosen), sources  # type: ignore[arg-type]

    def defaults(self) -> dict[str, float]:
        """What these say a request that sets nothing samples with (not its seed or logprobs)."""
        return {name: getattr(self, name) for name in _IN_RANGE}

    @property
    def penalized(self) -> bool:
        repetition = self.repetition_penalty not in (0.0, 1.0)
        return repetition or bool(self.presence_penalty or self.frequency_penalty)


# What a default may be, per field.
_IN_RANGE: dict[str, Callable[[float], bool]] = {
    "temperature": lambda v: v >= 0,
    "top_p": lambda v: 0 < v <= 1,
    "top_k": lambda v: v >= 0 and v == int(v),
    "repetition_penalty": lambda v: v >= 0,
    "presence_penalty": lambda v: -2 <= v <= 2,
    "frequency_penalty": lambda v: -2 <= v <= 2,
    **{
        f"{penalty}_context_size": lambda v: v >= 1 and v == int(v)
        for penalty in ("repetition", "presence", "frequency")
    },
}


@dataclass(frozen=True)
class ImageSpan:
    """Where one image's tokens are in a prompt, and what identifies them."""

    start: int  # where its tokens begin in the prompt's ids
    length: int  # how many (its placeholders and the markers between them)
    # A hash of what the model sees (the processed pixels and their grid): equal keys, equal
    # image tokens.
    key: bytes


@dataclass(frozen=True)
class PromptImages:
    """A vision model's images in one prompt."""

    spans: tuple[ImageSpan, ...]  # in prompt order
    # The processor's outputs for them together (pixel values, grids or sizes), numpy arrays:
    # what the model's vision tower and position ids are computed from.
    inputs: dict[str, Any] = field(compare=False, repr=False)

    def within(self, tokens: int) -> bool:
        """Whether every image's tokens lie in the prompt's first `tokens`."""
        return all(span.start + span.length <= tokens for span in self.spans)


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    stream: StreamSpec
    # None: as many tokens as the context holds after the prompt; more is clamped to that.
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    grammar: Grammar | None = None  # what the reply must match (constrained decoding)
    speculate: bool = True  # may guess tokens ahead (engine/speculation.py); same tokens either way
    # OpenAI's `n`: this many generations of the prompt, prefilled once, into one response. With
    # a seed, choice i samples with seed + i (n identical samples would be no choice).
    choices: int = 1
    images: PromptImages | None = None  # a vision model's images in the prompt
    # End the reply once it repeats a short cycle of tokens many times (the router's loop
    # guard: rust/loop_guard.rs).
    loop_guard: bool = False

    def cache_keys(self, ids: list[int] | None = None) -> list[int]:
        """What the prefix cache knows `ids` (the prompt, or the prompt and tokens after it) by:
        the ids themselves, but each image's tokens replaced by ids from its key. Negative, so
        never a vocabulary id: the same image in the same place matches, another image never
        does."""
        ids = self.prompt_ids if ids is None else ids
        if self.images is None:
            return ids
        return [*self._prompt_keys, *ids[len(self.prompt_ids) :]]

    @cached_property
    def _prompt_keys(self) -> list[int]:
        """The prompt's cache keys, made once."""
        keys = list(self.prompt_ids)
        for span in self.images.spans if self.images is not None else ():
            seed = int.from_bytes(span.key[:8], "little")
            keys[span.start : span.start + span.length] = [
                -1 - (seed + j) % (2**31 - 2) for j in range(span.length)
            ]
        return keys


class AdmissionError(Exception):
    """The request cannot be admitted."""


class PromptTooLong(AdmissionError):
    """Over the context, or (`memory`) over the tokens the KV memory budget holds."""

    def __init__(self, prompt_tokens: int, context_length: int, *, memory: bool = False) -> None:
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length
        self.memory = memory
        held = "the KV cache's memory budget (--kv-memory-gb) of" if memory else "a"
        super().__init__(
            f"{prompt_tokens} prompt tokens do not fit {held} {context_length}-token context"
        )


class QueueFull(AdmissionError):
    def __init__(self, retry_after_s: int) -> None:
        self.retry_after_s = retry_after_s
        super().__init__("too many requests are waiting")


class EngineStopped(AdmissionError):
    def __init__(self) -> None:
        super().__init__("the engine is not running")


class GenerationEngine(Protocol):
    """What the API needs of an engine (the real one, or a stand-in in tests and benchmarks)."""

    def admit(self, request: GenerationRequest) -> Reader:
        """Admit `request` and return its response's reader at once (one for all its choices),
        or raise an AdmissionError. Never blocks: generation happens on the engine's own
        thread."""
        ...

    def start(self) -> None: ...

    def busy(self) -> bool:
        """Whether it holds streams (generating, or waiting to be read)."""
        ...

    def stop(self) -> None:
        """Stop generating; open streams end with an error."""
        ...
