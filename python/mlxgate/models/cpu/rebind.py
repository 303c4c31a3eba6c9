"""Puts mlxgate's function in place of an mlx-lm function on one model instance, not in its module.

mlx-lm's model code calls module globals (`scaled_dot_product_attention`, `swiglu`, `mx`).
Writing our function into the module would give it to every model of that architecture in the
process. Here each submodule whose methods use the global gets a subclass whose methods (those
that use it: `__call__`, `as_linear`...) are the same code run with a copy of the module's
globals where that one name is bound to the replacement.
"""

from __future__ import annotations

import types
from typing import Any

import mlx.core as mx
import mlx.nn as nn

# (class, global name, replacement) -> the class whose methods see it under that name.
_rebound: dict[tuple[type, str, Any], type] = {}


def install(model: nn.Module, name: str, original: Any, replacement: Any) -> bool:
    """Give `model`'s modules that call `original` as the global `name` the `replacement` instead.

    CPU only: elsewhere MLX's own kernels are the fast ones. Returns whether any module took it.
    """
    if mx.default_device() != mx.cpu:
        return False
    taken = False
    for module in model.modules():
        if bound(type(module), name) is original:
            module.__class__ = _rebound_class(type(module), name, replacement)
            taken = True
    return taken


def installed(model: nn.Module, name: str, replacement: Any) -> bool:
    """Whether every module of `model` that calls the global `name` calls `replacement`, and one
    does."""
    found = [b for m in model.modules() if (b := bound(type(m), name)) is not None]
    return bool(found) and all(b is replacement for b in found)


def bound(cls: type, name: str) -> Any:
    """What the global `name` is in `cls.__call__`, or None if it calls no such global."""
    call = getattr(cls, "__call__", None)  # noqa: B004 (the method itself, not a test)
    if not isinstance(call, types.FunctionType) or name not in call.__code__.co_names:
        return None
    return call.__globals__.get(name)


def _methods_using(cls: type, name: str) -> dict[str, types.FunctionType]:
    """The methods of `cls` (its own and inherited, but nn.Module's) whose code uses `name`."""
    found: dict[str, types.FunctionType] = {}
    for klass in reversed(cls.__mro__):
        if klass in (object, nn.Module, dict):
            continue
        for attribute, value in vars(klass).items():
            if isinstance(value, types.FunctionType) and name in value.__code__.co_names:
                found[attribute] = value
            elif attribute in found:
                del found[attribute]  # overridden by a method that does not use it
    return found


def _rebound_class(cls: type, name: str, replacement: Any) -> type:
    key = (cls, name, replacement)
    if key not in _rebound:
        methods = {}
        for attribute, method in _methods_using(cls, name).items():
            namespace = {**method.__globals__, name: replacement}
            rebound = types.FunctionType(
                method.__code__, namespace, method.__name__, method.__defaults__, method.__closure__
            )
            rebound.__kwdefaults__ = method.__kwdefaults__
            rebound.__qualname__ = method.__qualname__
            methods[attribute] = rebound
        _rebound[key] = type(cls.__name__, (cls,), methods)
    return _rebound[key]
