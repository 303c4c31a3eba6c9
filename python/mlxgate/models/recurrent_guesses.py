"""Guesses over gated delta layers (Qwen3-Next, Qwen3.5): what a verify pass keeps so that each
row's recurrent state can be the one after any of its positions.

A recurrent layer overwrites its state with every token it reads, so a verify pass's rejected
guesses would stay in it. mlx-lm's gated delta layer reads a pass through two calls this module
watches on one model instance: its convolution gets the layer's conv state followed by the
pass's inputs (`conv1d`), and `gated_delta_update` gets the recurrent state before the pass and
every position's queries, keys, values and gates. While a pass is `recording`, each layer's two
calls are kept, in layer order (`LayerPass`). Once the engine knows how many positions each row
keeps, `LayerPass.restore` gives the layer's cache the state after them: the conv state is a
slice of the convolution's input, and the recurrent state is mlx-lm's own `gated_delta_update`
run again from the state before the pass over the same inputs, each row masked after its last
kept position (a masked position leaves the state as it was). The same operations on the same
inputs in the same order: a row keeps, bit for bit, the state the pass computed at that
position.

CPU only (mlx-lm computes the recurrence in a Metal kernel elsewhere), and the engine guesses
only where every recurrent layer of the model is watched (`watched`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gated_delta
from mlx_lm.models.cache import ArraysCache

from mlxgate.models.cpu import rebind

_NAME = "gated_delta_update"
_SIGNATURE = inspect.signature(gated_delta.gated_delta_update)


@dataclasses.dataclass(eq=False)
class LayerPass:
    """One gated delta layer's part of a verify pass."""

    conv_input: mx.array  # [rows, kernel - 1 + width, channels]: its conv state, then the pass
    update: tuple[tuple[Any, ...], dict[str, Any]] | None = None  # gated_delta_update's arguments

    def restore(self, cache: ArraysCache, columns: mx.array) -> None:
        """`cache` as it would be after the first `columns[row]` positions of the pass."""
        assert self.update is not None
        update = _SIGNATURE.bind(*self.update[0], **self.update[1])
        kernel = cache[0].shape[1]  # the conv state's positions
        width = self.conv_input.shape[1] - kernel
        taken = mx.arange(kernel)[None] + columns[:, None]
        cache[0] = mx.take_along_axis(self.conv_input, taken[..., None], axis=1)
        kept = mx.arange(width)[None] < columns[:, None]
        mask = update.arguments.get("mask")
        update.arguments["mask"] = kept if mask is None else kept & mask
        cache[1] = gated_delta.gated_delta_update(*update.args, **update.kwargs)[1]


class _Recording(threading.local):
    passes: list[LayerPass] | None = None  # None: no pass is being recorded on this thread


_recording = _Recording()


@contextlib.contextmanager
def recording() -> Iterator[list[LayerPass]]:
    """The layer passes of the model calls made inside (the engine's thread builds a pass's
    graph within the call, so the list is complete once it returns)."""
    passes: list[LayerPass] = []
    _recording.passes = passes
    try:
        yield passes
    finally:
        _recording.passes = None


def _recorded_update(*args: Any, **kwargs: Any) -> tuple[mx.array, mx.array]:
    """mlx-lm's `gated_delta_update`, its arguments kept while a pass is recorded."""
    passes = _recording.passes
    if passes is not None:
        passes[-1].update = (args, kwargs)
    return gated_delta.gated_delta_update(*args, **kwargs)  # type: ignore[no-any-return]


class _RecordedConv:
    """Mixed into a gated delta layer's convolution: keeps its input while a pass is recorded."""

    __slots__ = ()

    def __call__(self, x: mx.array) -> mx.array:
        passes = _recording.passes
        if passes is not None:
            passes.append(LayerPass(x))
        return super().__call__(x)  # type: ignore[misc,no-any-return]


_recorded_convs: dict[type, type] = {}


def watch(model: nn.Module) -> int:
    """Watch `model`'s gated delta layers (this instance only; once); returns how many it has."""
    rebind.install(model, _NAME, gated_delta.gated_delta_update, _recorded_update)
    # Qwen3-Next's and Qwen3.5's layer: one convolution over its conv state and the pass (others,
    # with a convolution per projection, are not watched).
    layers = [
        m
        for m in model.modules()
        if rebind.bound(type(m), _NAME) is _recorded_update and hasattr(m, "conv1d")
    ]
    for layer in layers:
        conv = layer.conv1d
        if not isinstance(conv, _RecordedConv):
            cls = type(conv)
            if cls not in _recorded_convs:
                _recorded_convs[cls] = type(cls.__name__, (_RecordedConv, cls), {})
            conv.__class__ = _recorded_convs[cls]
    return len(layers)
