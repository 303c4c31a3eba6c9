"""The one way the engine calls a loaded mlx-lm model: batched decode, cancellable prefill."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from mlxgate.models import recurrent_guesses, rope_switch
from mlxgate.models.cpu import attention
from mlxgate.models.rope_switch import ScaledRows


class ModelAdapter:
    """What the engine needs from an mlx-lm model, through the model's own code.

    The prefill runs mlx-lm's backbone as it is: the model without its LM head (the submodule
    that holds the model's `layers`: `model.model`, `model.backbone`, ...), or the whole model if
    it keeps no such part.
    It can stop between layers because each decoder layer instance in `backbone.layers` is
    wrapped: while a prefill with a stop check runs, a layer evaluates its output and ends the
    pass if the check says so. A model without a `layers` list is prefilled whole, without that
    chance to stop early.

    Each call says which of its rows are served with the scaled rope (`scaled`): it matters only
    to a model whose ropes are switched (models/rope_switch.py), which serves the rest with its
    own.

    With `kv_bits` (8 or 4; 0: floats), the layers the model gives a plain `KVCache` keep their
    keys/values quantized instead, in groups of `kv_group_size` features (mlx-lm's
    `QuantizedKVCache`, whose attention mlx-lm's `scaled_dot_product_attention` picks); a sliding
    window, a recurrent state or a `CacheList` stays as the model made it.
    """

    def __init__(self, model: nn.Module, kv_bits: int = 0, kv_group_size: int = 64) -> None:
        if kv_bits not in (0, 4, 8):
            raise ValueError(f"--kv-bits must be 0 (off), 4 or 8, not {kv_bits}")
        if kv_bits and kv_group_size not in (32, 64, 128):
            raise ValueError(f"--kv-group-size must be 32, 64 or 128, not {kv_group_size}")
        self.model = model
        self.kv_bits = kv_bits
        self.kv_group_size = kv_group_size
        # Arrays a model builds in its constructor outside its parameters (e.g. rotary
        # frequencies) are lazy until first used; MLX streams are per thread, so they are
        # computed here rather than first on the engine's thread, which cannot run them.
        mx.eval([v for m in model.modules() for v in m.values() if isinstance(v, mx.array)])
        self.backbone = _backbone(model)
        layers = getattr(self.backbone, "layers", None)
        # A pipelined model (ranks.py) runs its layers between a receive from one rank and a
        # send to another: a stop between two of them would leave the others waiting.
        pipelined = getattr(self.backbone, "pipeline_size", 1) > 1
        self.layers: list[nn.Module] = (
            list(layers) if isinstance(layers, list) and not pipelined else []
        )
        self._check = _make_stoppable(self.layers)
        # How many layers a prefill runs between two stop checks (engine/lockstep.py: across
        # ranks a check costs a collective).
        self.stop_every = 1
        self._rope_rows = rope_switch.rows_of(model)
        # Recurrent layers whose verify passes can be taken back (models/recurrent_guesses.py).
        self.watched = recurrent_guesses.watch(model)

    def make_cache(self) -> list[Any]:
        """A fresh single-sequence cache per layer, of the kinds the model asks for (plain
        attention quantized with `kv_bits`)."""
        caches = make_prompt_cache(self.model)
        if not self.kv_bits:
            return caches
        return [
            QuantizedKVCache(group_size=self.kv_group_size, bits=self.kv_bits)
            if type(cache) is KVCache
            else cache
            for cache in caches
        ]

    def check_quantized_kv(self) -> str:
        """With `kv_bits`: one token through the model with its quantized caches (a head size the
        group size does not divide, or attention code that reads the keys itself, fails here
        rather than at a client's request), then what is quantized, in words."""
        caches = self.make_cache()
        quantized = sum(type(cache) is QuantizedKVCache for cache in caches)
        if not quantized:
            return "no layer keeps plain attention keys/values: --kv-bits changes nothing"
        try:
            mx.eval(self.model(mx.array([[0, 0]], dtype=mx.uint32), cache=caches))
        except Exception as exc:
            raise ValueError(
                f"--kv-bits {self.kv_bits} --kv-group-size {self.kv_group_size}: this model "
                f"cannot attend over quantized keys/values ({type(exc).__name__}: {exc})"
            ) from exc
        per_token = floats = 0.0
        for cache in caches:
            if type(cache) is QuantizedKVCache:
                triples: Any = (cache.keys, cache.values)
                for packed, scales, biases in triples:
                    columns = packed.shape[2]
                    per_token += (packed.nbytes + scales.nbytes + biases.nbytes) / columns
                    features = scales.shape[-1] * self.kv_group_size
                    floats += scales.size // scales.shape[-1] * features * scales.itemsize / columns
        kept = len(caches) - quantized
        return (
            f"{quantized} attention layers at {self.kv_bits} bits (groups of "
            f"{self.kv_group_size}): {per_token / 1024:.1f} KiB a token instead of "
            f"{floats / 1024:.1f} KiB ({per_token / floats:.2f}x)"
            + (f"; {kept} other layers (windows, recurrent state) keep floats" if kept else "")
        )

    @property
    def cancellable(self) -> bool:
        """Whether a prefill can stop between layers."""
        return bool(self.layers)

    @property
    def switched_rope(self) -> bool:
        """Whether rows may be served with the model's own rope rather than the scaled one."""
        return self._rope_rows is not None

    @property
    def per_row_positions(self) -> bool:
        """Whether decoding needs each row's rope delta (a vision model's M-RoPE)."""
        return False

    @property
    def banded_attention(self) -> bool:
        """Whether the attention attends band by band (takes a `BandedCache`)."""
        return attention.installed(self.model)

    def decode(
        self,
        inputs: mx.array,
        caches: Sequence[Any],
        scaled: ScaledRows = True,
        rope_deltas: np.ndarray | None = None,
    ) -> mx.array:
        """Next-token logits [batch, vocab] for one input token per row. (`rope_deltas`: per
        row, for a model with `per_row_positions`.)"""
        self._scale(scaled)
        logits: mx.array = self.model(inputs[:, None], cache=caches)[:, -1, :]
        return logits

    def verify(
        self,
        inputs: mx.array,
        caches: Sequence[Any],
        scaled: ScaledRows = True,
        rope_deltas: np.ndarray | None = None,
    ) -> mx.array:
        """Logits [batch, positions, vocab] for `inputs` [batch, positions]: each row's input
        token and the tokens guessed after it (speculative decoding), all added to `caches`."""
        self._scale(scaled)
        logits: mx.array = self.model(inputs, cache=caches)
        return logits

    def prefill(
        self,
        tokens: mx.array,
        caches: Sequence[Any],
        should_stop: Callable[[], bool] | None = None,
        scaled: ScaledRows = True,
        inputs: dict[str, Any] | None = None,
    ) -> bool:
        """Add `tokens` [batch, n] to `caches` (evaluated). False if `should_stop()` said so
        after a layer; the caches are then partly filled and of no use. (`inputs`: a vision
        model's embeddings and positions for the tokens.)"""
        self._scale(scaled)
        self._check.should_stop = _every(should_stop, self.stop_every)
        try:
            self.backbone(tokens, cache=caches, **self._backbone_inputs(tokens, caches, inputs))
        except _Stopped:
            return False
        finally:
            self._check.should_stop = None
        mx.eval([c.state for c in caches])
        return True

    def _backbone_inputs(
        self, tokens: mx.array, caches: Sequence[Any], inputs: dict[str, Any] | None
    ) -> dict[str, Any]:
        """What the backbone is called with besides the tokens and caches."""
        return inputs or {}

    def _scale(self, scaled: ScaledRows) -> None:
        # The graph is built (and the rope picked) during the call, before anything else runs
        # on this thread, so the state needs no reset.
        if self._rope_rows is not None:
            self._rope_rows.set(scaled)


def _backbone(model: nn.Module) -> nn.Module:
    """The submodule that runs the model's decoder layers and returns hidden states: the
    shallowest one holding the layers the model lists (`model.model`, `model.backbone`,
    `model.language_model.model`, ...), else the model itself. (A pipelined model lists its
    rank's layers; its backbone holds None for the others.)"""
    listed = getattr(model, "layers", None)
    modules = sorted(model.named_modules(), key=lambda named: named[0].count("."))
    for name, module in modules:
        layers = getattr(module, "layers", None)
        if not (name and isinstance(layers, list) and layers):
            continue
        held = [layer for layer in layers if layer is not None]
        if not isinstance(listed, list) or (
            len(held) == len(listed) and all(a is b for a, b in zip(held, listed, strict=True))
        ):
            return module
    return model


def _every(check: Callable[[], bool] | None, layers: int) -> Callable[[], bool] | None:
    """`check`, asked after every `layers`-th layer only."""
    if check is None or layers == 1:
        return check
    count = itertools.count(1)
    return lambda: next(count) % layers == 0 and check()


class _Stopped(Exception):
    """Raised by a layer to end a prefill whose clients went away."""


class _StopCheck(threading.local):
    """The running prefill's stop check, shared by the layers of one model; None outside one.

    Per thread, so that a prefill on one thread never sees another thread's check.
    """

    should_stop: Callable[[], bool] | None = None
    # Around each layer's evaluation (a vision tower's blocks take turns with the engine's steps).
    evaluating: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext


class _Stoppable:
    """Mixed into a decoder layer's class: checks `should_stop` after the layer, during prefill."""

    __slots__ = ()
    _stop_check: _StopCheck

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = super().__call__(*args, **kwargs)  # type: ignore[misc]
        should_stop = self._stop_check.should_stop
        if should_stop is not None:
            with self._stop_check.evaluating():
                mx.eval(out)
            if should_stop():
                raise _Stopped
        return out


_stoppable: dict[type, type] = {}  # layer class -> its _Stoppable subclass


def _make_stoppable(layers: list[nn.Module]) -> _StopCheck:
    """Wrap each layer instance (once: another adapter over the same model shares the check)."""
    wrapped = [layer for layer in layers if isinstance(layer, _Stoppable)]
    check = wrapped[0]._stop_check if wrapped else _StopCheck()
    for layer in layers:
        if isinstance(layer, _Stoppable):
            continue
        cls = type(layer)
        if cls not in _stoppable:
            _stoppable[cls] = type(cls.__name__, (_Stoppable, cls), {})
        layer.__class__ = _stoppable[cls]
        object.__setattr__(layer, "_stop_check", check)
    return check
