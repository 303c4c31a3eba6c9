"""The context a model is served with: its own, a shorter one, or a longer one by rope scaling.

Past the model's own context (`--context-length N`), mlxgate scales the rotary position
embedding the way the model's config would: it writes a `rope_scaling` entry (YaRN, or linear
position interpolation, by N / native over the native length) and lets the architecture's own
code build the rope from it (mlx-lm's `rope_utils.initialize_rope`). Some architectures build
their rope without reading the config's scaling; the built model is checked, and a model whose
rope did not take the scaling is refused at start-up rather than served with positions it was
never trained on. A sequence that fits the native context is still served with the model's own
rope (models/rope_switch.py): the scaling costs short answers their quality.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import mlx.nn as nn

from mlxgate.models import rope_switch, yarn

ROPE_SCALINGS = ("yarn", "linear")
_NAMES = {"yarn": "YaRN", "linear": "linear"}
# Rope types that do not stretch positions (mrope only splits the rotary dimensions).
_UNSCALED = (None, "default", "mrope")


class ContextLengthError(ValueError):
    """A `--context-length` the model cannot be served with (a start-up error)."""


@dataclass(frozen=True)
class ServedContext:
    """How many tokens of context the server admits, and how that relates to the model's own."""

    length: int
    native: int  # what the model's config covers (with the config's own rope scaling, if any)
    scaling: str | None = None  # "yarn" or "linear" when mlxgate stretches the rope to `length`
    # The model also keeps its own rope, for sequences that fit `native` (models/rope_switch.py).
    native_window: bool = False

    @property
    def factor(self) -> float:
        return self.length / self.native

    def rope_scaling(self) -> dict[str, Any] | None:
        """The config entry that gives the model this context (None: the model's own rope)."""
        if self.scaling is None:
            return None
        return {
            "type": self.scaling,
            "rope_type": self.scaling,  # the key newer configs (transformers >= 5) use
            "factor": self.factor,
            "original_max_position_embeddings": self.native,
        }

    def window(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """The context a sequence is served in: the model's own, with its own rope, when the
        prompt and `max_tokens` fit it (unset: the room the native window leaves), else all of
        `length`, with the scaled rope."""
        room = self.native - prompt_tokens
        fits = room >= 1 and (max_tokens is None or max_tokens <= room)
        return self.native if self.native_window and fits else self.length

    def describe(self) -> str:
        """E.g. "32768 (YaRN x4 over 8192, its own rope within)", "4096 (model: 8192)", "8192"."""
        if self.scaling is not None:
            own = ", its own rope within" if self.native_window else ""
            name = _NAMES[self.scaling]
            return f"{self.length} ({name} x{self.factor:.3g} over {self.native}{own})"
        if self.length != self.native:
            return f"{self.length} (model: {self.native})"
        return str(self.length)


def choose(
    arch: str,
    native: int,
    requested: int | None,
    scaling: str = "yarn",
    their_scaling: str | None = None,
) -> ServedContext:
    """The context to serve for `--context-length requested` (None: the model's own).

    `their_scaling` describes a rope scaling the model's config already has: mlxgate does not
    stack a second one on it, so a longer context than that one covers is refused.
    """
    if scaling not in ROPE_SCALINGS:
        raise ContextLengthError(f"unknown rope scaling {scaling!r} (known: yarn, linear)")
    if requested is None or requested == native:
        return ServedContext(native, native)
    if requested < 1:
        raise ContextLengthError(f"--context-length {requested}: must be at least 1")
    if requested < native:
        return ServedContext(requested, native)
    if their_scaling is not None:
        raise ContextLengthError(
            f"--context-length {requested}: this {arch} model's config already scales its "
            f"rotary embedding ({their_scaling}) to {native} tokens, and mlxgate does not scale "
            f"it again. Serve {native} tokens or fewer, or change rope_scaling in its config.json"
        )
    return ServedContext(requested, native, scaling)


def their_scaling(config: dict[str, Any]) -> dict[str, Any] | None:
    """The rope scaling a (language model's) config.json declares, if it stretches positions."""
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if isinstance(value, dict):
            kind = value.get("type") or value.get("rope_type")
            if kind not in _UNSCALED:
                return value
    return None


def describe_scaling(scaling: dict[str, Any]) -> str:
    kind = scaling.get("type") or scaling.get("rope_type")
    factor = scaling.get("factor")
    return f"{kind} x{factor:.3g}" if isinstance(factor, int | float) else str(kind)


def covered(max_position_embeddings: int, scaling: dict[str, Any] | None) -> int:
    """The context a config covers: its `max_position_embeddings`, or what its own scaling
    stretches the original length to, when that is more (Qwen's configs leave
    max_position_embeddings at the original length and add YaRN on top)."""
    if scaling is None:
        return max_position_embeddings
    factor, original = scaling.get("factor"), scaling.get("original_max_position_embeddings")
    if isinstance(factor, int | float) and isinstance(original, int):
        return max(max_position_embeddings, math.floor(factor * original))
    return max_position_embeddings


def for_config(
    config: dict[str, Any], requested: int | None, scaling: str = "yarn"
) -> tuple[ServedContext, dict[str, Any]]:
    """For an mlx-lm model's config.json: the context to serve for `--context-length requested`
    and the `model_config` overrides that give it to mlx-lm's `load_model`."""
    arch = str(config.get("model_type"))
    text_key = _text_key(config)
    text: dict[str, Any] = config[text_key] if text_key else config
    theirs = their_scaling(text)
    maximum = config.get("max_position_embeddings") or text.get("max_position_embeddings", 4096)
    served = choose(
        arch,
        covered(int(maximum), theirs),
        requested,
        scaling,
        describe_scaling(theirs) if theirs else None,
    )
    if served.scaling is None:
        return served, {}
    scaled = {**text, "rope_scaling": served.rope_scaling()}
    if isinstance(text.get("rope_parameters"), dict):  # it also holds rope_theta and the like
        scaled["rope_parameters"] = {**text["rope_parameters"], **scaled["rope_scaling"]}
    overrides = {text_key: scaled} if text_key else scaled
    if "model_file" not in config:  # (a custom architecture is only checked once built)
        _check_args_take(config | overrides, arch, served)
    return served, overrides


def _text_key(config: dict[str, Any]) -> str | None:
    """Where the language model's settings are: a multimodal wrapper keeps them in text_config."""
    return "text_config" if isinstance(config.get("text_config"), dict) else None


def _check_args_take(config: dict[str, Any], arch: str, served: ServedContext) -> None:
    """Some architectures' ModelArgs accept only their own kinds of rope scaling."""
    from mlx_lm.utils import _get_classes

    try:
        _get_classes(config)[1].from_dict(config)
    except (ValueError, KeyError, TypeError) as exc:
        raise ContextLengthError(
            f"{arch} does not take a {served.scaling} rope scaling, so mlxgate cannot serve "
            f"--context-length {served.length} past its native {served.native} tokens: {exc}"
        ) from exc


def check_scaled(model: nn.Module, config: dict[str, Any], context: ServedContext) -> None:
    """Raise ContextLengthError unless `model` (built from `config`) took `context`'s scaling.

    Every rotary embedding must be scaled, except, in a model with sliding-window layers,
    the windowed layers' own (Gemma 3 scales only its global layers: a window never spans
    positions farther apart than the native context).
    """
    if context.scaling is None:
        return
    arch = str(config.get("model_type"))
    text_key = _text_key(config)
    windowed = isinstance((config[text_key] if text_key else config).get("sliding_window"), int)
    ropes = [module for module in model.modules() if _is_rope(module)]
    scaled = [rope for rope in ropes if _takes(rope, context)]
    stretch = f"--context-length {context.length} past its native {context.native} tokens"
    if not ropes:
        raise ContextLengthError(
            f"{arch} has no rotary position embedding that mlxgate could scale for {stretch}; "
            f"serve at most {context.native} tokens"
        )
    if not scaled or (len(scaled) < len(ropes) and not windowed):
        raise ContextLengthError(
            f"{arch} builds its rotary position embedding without the config's rope_scaling "
            f"({len(ropes) - len(scaled)} of {len(ropes)} unscaled), so mlxgate cannot give it "
            f"{stretch}; serve at most {context.native} tokens"
        )


def switch_rope(model: nn.Module, native: nn.Module, context: ServedContext) -> ServedContext:
    """Give `model` (scaled to `context`) the rope of `native` (the same architecture built
    without the scaling) for sequences that fit the native window; `context` says if it took."""
    if context.scaling is None:
        return context
    rows = rope_switch.install(model, native, lambda m: _is_rope(m) and _takes(m, context))
    return replace(context, native_window=rows is not None)


def _is_rope(module: nn.Module) -> bool:
    name = type(module).__name__
    return isinstance(module, nn.RoPE) or name.endswith("RoPE") or "Rotary" in name


def _takes(rope: nn.Module, context: ServedContext) -> bool:
    from mlx_lm.models.rope_utils import YarnRoPE

    if context.scaling == "linear":
        return isinstance(rope, nn.RoPE) and math.isclose(rope.scale, 1 / context.factor)
    scaling = context.rope_scaling()
    assert scaling is not None
    return isinstance(rope, YarnRoPE) and math.isclose(rope.mscale, yarn.attention_factor(scaling))
