"""Give one model's fla modules other kernels, without touching fla.

fla's layers call their kernels through module globals (``chunk_gla(...)``
inside ``GatedLinearAttention.forward``). Rebinding those globals would change
fla for the whole process. Here a model's modules get, instead, a subclass of
their own class whose methods are fla's very code objects evaluated against a
copy of their module's globals with some names replaced (``rebased``). Only the
instances passed to ``bind`` change class; fla's classes and modules stay as
shipped, so any other model in the process runs fla untouched.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping

import torch.nn as nn

Replacements = Mapping[object, Callable]
"""fla object (function or method) -> what a bound model calls instead."""
ModuleNames = Mapping[str, Mapping[str, object]]
"""module name -> {global name: value} for names whose value cannot key ``Replacements`` (e.g. None)."""

_bound_classes: dict[tuple[type, str], type] = {}


def rebased(fn: types.FunctionType, names: Mapping[str, object]) -> types.FunctionType:
    """``fn``'s code with ``names`` replaced in the globals it sees (its module is not changed).

    The copy has no ``__name__``: dynamo would otherwise guard the names
    through the module of that name (fla's, unchanged) instead of this dict.
    """
    scope = {**fn.__globals__, **names}
    scope.pop("__name__", None)  # absent when fn is itself a rebased copy
    new = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    new.__wrapped__ = fn
    return new


def _global_overrides(fn: types.FunctionType, replacements: Replacements, names: ModuleNames) -> dict[str, object]:
    """The global names ``fn`` reads that hold an object ``replacements`` replaces, or that ``names`` sets."""
    by_name = names.get(fn.__globals__.get("__name__"), {})
    overrides = {}
    for name in fn.__code__.co_names:
        value = fn.__globals__.get(name)
        if name in by_name:
            overrides[name] = by_name[name]
        elif value is not None and _hashable(value) and value in replacements:
            overrides[name] = replacements[value]
    return overrides


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def bound_class(cls: type, replacements: Replacements, key: str, names: ModuleNames = {}) -> type:
    """``cls``, or a cached subclass of it whose methods see ``replacements``.

    Methods are taken along the MRO (the first definition wins, as Python
    resolves them); a method that is itself replaced (``Class.forward``) is
    swapped whole. A class replaced by a subclass of its own becomes that subclass.
    """
    replacement = replacements.get(cls) if _hashable(cls) else None
    if isinstance(replacement, type) and issubclass(replacement, cls):
        return replacement
    cache_key = (cls, key)
    if cache_key not in _bound_classes:
        methods = {}
        for klass in reversed(cls.__mro__):
            for name, fn in vars(klass).items():
                if not isinstance(fn, types.FunctionType):
                    methods.pop(name, None)
                    continue
                if fn in replacements:
                    methods[name] = replacements[fn]
                elif overrides := _global_overrides(fn, replacements, names):
                    methods[name] = rebased(fn, overrides)
                else:
                    methods.pop(name, None)
        _bound_classes[cache_key] = type(cls.__name__, (cls,), {**methods, "__module__": cls.__module__}) if methods else cls
    return _bound_classes[cache_key]


def bind(model: nn.Module, replacements: Replacements, key: str, names: ModuleNames = {}) -> nn.Module:
    """Make every module of ``model`` call ``replacements`` (in place; returns ``model``).

    Instance attributes holding a replaced function (fla's ``self.gate_fn =
    ACT2FN['swish']``) are replaced on the instance.
    """
    for module in model.modules():
        module.__class__ = bound_class(type(module), replacements, key, names)
        for name, value in list(vars(module).items()):
            if callable(value) and _hashable(value) and value in replacements:
                setattr(module, name, replacements[value])
    return model
