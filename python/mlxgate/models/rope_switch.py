"""Two rotary embeddings on one set of weights: the model's own for a sequence that fits its
native context, the scaled one (YaRN, linear) for a sequence that may not.

Scaling the rope changes every answer a little, short ones too: on SmolLM2-135M at YaRN x4,
llama.cpp and mlx-lm alike turn "What is the capital of France?" into French nonsense, mostly
through YaRN's attention temperature. So, as Phi-3's LongRoPE switches on length, a sequence is
served with the model's own rope when its prompt and output fit the native window, and with the
scaled rope otherwise (`ServedContext.window`). The choice is per sequence, made once at
admission, so one sequence's keys all come from one rope; a batch holds rows of both, and each
switched rope module picks per row (`RopeRows`, set by the `ModelAdapter` before each call).
"""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

# Which rows of a forward pass use the scaled rope: all (True), none (False) or, per row (batch
# first), a boolean array.
ScaledRows = bool | np.ndarray


class RopeRows(threading.local):
    """The rows the running forward pass scales, shared by the switched ropes of one model:
    all (True), none (False) or a boolean array, per row. Set once per pass (`set`), read by
    every rope of every layer.

    Per thread, as the stop check of a prefill is: a pass on one thread never sees another's.
    """

    scaled: bool | mx.array = True

    def set(self, scaled: ScaledRows) -> None:
        if not isinstance(scaled, np.ndarray):
            self.scaled = scaled
        elif scaled.all() or not scaled.any():  # one rope for the whole pass
            self.scaled = bool(scaled.all())
        else:
            self.scaled = mx.array(scaled)


class SwitchedRoPE(nn.Module):
    """In place of a scaled rope: the scaled one for rows the pass scales, the model's own
    (`native`) for the rest.

    Both are private members: the model's parameter tree stays the one mlx-lm's class has (a
    rope holds no parameters), so weights load and copy between the two as before.
    """

    def __init__(self, native: nn.Module, scaled: nn.Module, rows: RopeRows) -> None:
        super().__init__()
        self._native = native
        self._scaled = scaled
        self._rows = rows
        # Frequencies a rope computed lazily are computed here, on the loading thread: another
        # thread's stream cannot run them (see ModelAdapter).
        mx.eval([v for rope in (native, scaled) for v in rope.values() if isinstance(v, mx.array)])

    @property
    def native(self) -> nn.Module:
        return self._native

    @property
    def scaled(self) -> nn.Module:
        return self._scaled

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        rows = self._rows.scaled
        if rows is True:
            return self._scaled(x, offset=offset)  # type: ignore[no-any-return]
        if rows is False:
            return self._native(x, offset=offset)  # type: ignore[no-any-return]
        pick = rows.reshape(-1, *([1] * (x.ndim - 1)))
        return mx.where(pick, self._scaled(x, offset=offset), self._native(x, offset=offset))


def install(model: nn.Module, native: nn.Module, is_scaled: Any) -> RopeRows | None:
    """Put a `SwitchedRoPE` in place of each rope of `model` that `is_scaled(rope)` says is
    scaled, its native side the rope at the same place in `native` (the same architecture built
    without the scaling, weights never read). Returns the rows state the ropes share, or None if
    `model` has no scaled rope."""
    natives = dict(native.named_modules())
    rows = RopeRows()
    switched = [
        (name, SwitchedRoPE(natives[name], module, rows))
        for name, module in model.named_modules()
        if name and not isinstance(module, SwitchedRoPE) and is_scaled(module)
    ]
    model.update_modules(tree_unflatten(switched))
    return rows if switched else None


def rows_of(model: nn.Module) -> RopeRows | None:
    """The rows state of `model`'s switched ropes, if it has any."""
    for module in model.modules():
        if isinstance(module, SwitchedRoPE):
            return module._rows
    return None
