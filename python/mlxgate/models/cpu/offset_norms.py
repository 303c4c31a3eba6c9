"""Gemma's RMSNorm scales by 1 + weight: that sum made once per weight, not in every call.

mlx-lm's Gemma norms (and their mlx-vlm copies) compute `mx.fast.rms_norm(x, 1.0 + self.weight,
self.eps)`, so every call adds the offset again: 109 norms a step of Gemma 3 270M, one MLX op
each. Here each such module of one model instance keeps the sum beside its weight (recomputed
if the weight is replaced) and passes it to the same norm: the same numbers, fewer ops.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import mlx.core as mx
import mlx.nn as nn

_OFFSET_NORM = "return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)"


# class -> its class with the sum held, or None where it is no offset norm.
_held: dict[type, type | None] = {}


def _held_class(cls: type) -> type | None:
    if cls not in _held:
        _held[cls] = None
        if _adds_the_offset(cls):
            _held[cls] = type(cls.__name__, (cls,), {"__call__": _offset_norm_call})
    return _held[cls]


def _adds_the_offset(cls: type) -> bool:
    """Whether `cls.__call__` is the offset norm (its whole body that one line)."""
    call = vars(cls).get("__call__")
    if call is None:
        return False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(call)))
    except (OSError, TypeError, SyntaxError):
        return False
    body = tree.body[0].body if isinstance(tree.body[0], ast.FunctionDef) else []
    return len(body) == 1 and ast.unparse(body[0]) == _OFFSET_NORM


def _plus_one(norm: nn.Module) -> mx.array:
    weight = norm.weight
    held = norm.__dict__.get("_plus_one")
    if held is None or held[0] is not weight:
        held = (weight, 1.0 + weight)
        norm.__dict__["_plus_one"] = held
    return held[1]  # type: ignore[no-any-return]


def _offset_norm_call(self: nn.Module, x: mx.array) -> mx.array:
    return mx.fast.rms_norm(x, _plus_one(self), self.eps)


def install(model: nn.Module) -> bool:
    """Give `model`'s offset norms (this instance only) their sums made once. Returns whether
    any module took it."""
    taken = []
    for module in model.modules():
        held = _held_class(type(module))
        if held is not None:
            module.__class__ = held
            taken.append(_plus_one(module))
    mx.eval(taken)
    return bool(taken)
