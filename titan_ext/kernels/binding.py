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
import weakref
from collections.abc import Callable, Mapping

import torch.nn as nn

Replacements = Mapping[object, Callable]
"""fla object (function or method) -> what a bound model calls instead."""
ModuleNames = Mapping[str, Mapping[str, object]]
"""module name -> {global name: value} for names whose value cannot key ``Replacements`` (e.g. None)."""

_bound_classes: dict[tuple[type, str], type] = {}


def rebased(fn: types.FunctionType, names: Mapping[str, object], closure=None) -> types.FunctionType:
    """``fn``'s code with ``names`` replaced in the globals it sees (its module is not changed), and
    ``closure`` (cells) in place of its own.

    The copy has no ``__name__``: dynamo would otherwise guard the names
    through the module of that name (fla's, unchanged) instead of this dict.
    """
    scope = {**fn.__globals__, **names}
    scope.pop("__name__", None)  # absent when fn is itself a rebased copy
    new = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__ if closure is None else closure)
    new.__dict__.update(fn.__dict__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    new.__wrapped__ = fn
    return new


def _rebind(fn: types.FunctionType, replacements: Replacements, names: ModuleNames, used: set,
            seen: frozenset = frozenset()) -> types.FunctionType | None:
    """A copy of ``fn`` that sees the replacements, or None where it reads none of them.

    Read through decorators: a wrapper made by ``functools.wraps``
    (transformers >= 5.24 wraps each attention ``forward`` in
    ``deprecate_kwarg``) runs the function it wraps from its closure, with
    that function's module globals; the wrapped function is rebound and the
    wrapper copied around it.
    """
    overrides = _global_overrides(fn, replacements, names, used)
    wrapped = fn.__dict__.get("__wrapped__")
    inner = None
    if isinstance(wrapped, types.FunctionType) and wrapped not in seen and wrapped.__code__ is not fn.__code__:
        inner = _rebind(wrapped, replacements, names, used, seen | {fn})
    if not overrides and inner is None:
        return None
    closure = None
    if inner is not None:
        closure = tuple(types.CellType(inner) if holds(cell, wrapped) else cell for cell in fn.__closure__ or ())
        if not any(holds(cell, wrapped) for cell in fn.__closure__ or ()):
            return rebased(fn, overrides) if overrides else None  # wraps it, but does not call it from a closure
    new = rebased(fn, overrides, closure)
    if inner is not None:
        new.__wrapped__ = inner  # read through to the rebound function (``kernels.unported``)
    return new


def holds(cell, value) -> bool:
    """Whether a closure cell holds ``value`` (an empty cell holds nothing)."""
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def _global_overrides(fn: types.FunctionType, replacements: Replacements, names: ModuleNames, used: set) -> dict[str, object]:
    """The global names ``fn`` reads that hold an object ``replacements`` replaces, that ``names`` sets, or
    that hold a transformers hub wrapper calling a function ``replacements`` replaces (``hub_wrapper``)."""
    module = fn.__globals__.get("__name__")
    by_name = names.get(module, {})
    overrides = {}
    for name in fn.__code__.co_names:
        value = fn.__globals__.get(name)
        if name in by_name:
            overrides[name] = by_name[name]
            used.add((module, name))
        elif value is not None and _hashable(value) and value in replacements:
            overrides[name] = replacements[value]
            used.add(value)
        elif (implementation := hub_implementation(value)) is not None and _hashable(implementation) and (
                implementation in replacements):
            overrides[name] = hub_wrapper(value, replacements[implementation])
            used.add(implementation)
    return overrides


_HUB_WRAPPER = ("transformers.integrations.hub_kernels", "wrapped", {"implementation", "applicable_params"})
"""transformers' ``use_kernel_func_from_hub_with_fallback(func_name, package)`` wrapper: its module, its
code's name, and the closure variables it calls through (the package's function, found by name at import,
and that function's parameter names, to which it filters the caller's keywords)."""


def hub_implementation(value) -> object | None:
    """The function a transformers hub wrapper calls (fla's ``chunk_gated_delta_rule``, ...), or None where
    ``value`` is no such wrapper.

    transformers >= 5.2x modeling files call fla's kernels through module globals
    (``torch_chunk_gated_delta_rule = use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule",
    "fla")(torch_fn)``) whose ``__module__`` and name are the modeling file's (``functools.wraps``), while the
    closure holds the package's function whenever the package imports (else ``torch_fn`` itself).
    """
    if not isinstance(value, types.FunctionType):
        return None
    module, name, free = _HUB_WRAPPER
    code = value.__code__
    if code.co_name != name or value.__globals__.get("__name__") != module or not free <= set(code.co_freevars):
        return None
    return value.__closure__[code.co_freevars.index("implementation")].cell_contents


_hub_wrappers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
"""(transformers' wrapper, replacement) -> its copy, while a bound class holds the copy (a replacement that
holds a job's state, e.g. a process group, is not kept alive past its classes: ``forget``)."""


def hub_wrapper(wrapper: types.FunctionType, replacement) -> types.FunctionType:
    """A copy of transformers' hub ``wrapper`` calling ``replacement`` instead of its implementation: the same
    code, so the same contract (the caller's keywords filtered to the implementation's parameter names, which
    a replacement taking fla's signature whole shares; the torch path under ``torch.export``)."""
    key = (wrapper, replacement) if _hashable(replacement) else None
    new = None if key is None else _hub_wrappers.get(key)
    if new is None:
        cells = tuple(types.CellType(replacement) if var == "implementation" else cell
                      for var, cell in zip(wrapper.__code__.co_freevars, wrapper.__closure__))
        new = rebased(wrapper, {}, cells)
        new.__wrapped__ = wrapper.__wrapped__  # transformers' torch function, as functools.wraps left it
        if key is not None:
            _hub_wrappers[key] = new
    return new


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
    swapped whole, by a replacement that itself sees the other replacements. A class
    replaced by a subclass of its own becomes that subclass.
    """
    replacement = replacements.get(cls) if _hashable(cls) else None
    if isinstance(replacement, type) and issubclass(replacement, cls):
        _uses[cls, key] = {cls}
        return replacement
    cache_key = (cls, key)
    if cache_key not in _bound_classes:
        methods, used = {}, set()
        for klass in reversed(cls.__mro__):
            for name, fn in vars(klass).items():
                if not isinstance(fn, types.FunctionType):
                    methods.pop(name, None)
                    continue
                if fn in replacements:  # swapped whole; the replacement sees the other replacements too
                    new = replacements[fn]
                    rebound = _rebind(new, replacements, names, used) if isinstance(new, types.FunctionType) else None
                    methods[name] = new if rebound is None else rebound
                    used.add(fn)
                elif (new := _rebind(fn, replacements, names, used)) is not None:
                    methods[name] = new
                else:
                    methods.pop(name, None)
        _bound_classes[cache_key] = type(cls.__name__, (cls,), {**methods, "__module__": cls.__module__}) if methods else cls
        _uses[cache_key] = used
    return _bound_classes[cache_key]


_uses: dict[tuple[type, str], set] = {}
"""(class, key) -> the replacements (objects, or (module, name) pairs of ``names``) its bound class uses."""


def forget(prefix: str) -> None:
    """Drop the cached classes of every key starting with ``prefix``. The models bound with them keep their
    classes; a binding that holds one job's state (a process group) is never looked up again."""
    for cache in (_bound_classes, _uses):
        for cache_key in [k for k in cache if k[1].startswith(prefix)]:
            del cache[cache_key]


def bind(model: nn.Module, replacements: Replacements, key: str, names: ModuleNames = {}) -> set:
    """Make every module of ``model`` call ``replacements`` (in place).

    Instance attributes holding a replaced function (fla's ``self.gate_fn =
    ACT2FN['swish']``) are replaced on the instance. Returns what was
    replaced (objects of ``replacements``, ``(module, name)`` pairs of
    ``names``): a caller that needs a replacement checks it is there, since a
    host release that renames what it calls would otherwise leave the model
    silently unchanged.
    """
    used = set()
    for module in model.modules():
        cls = type(module)
        module.__class__ = bound_class(cls, replacements, key, names)
        used |= _uses[cls, key]
        for name, value in list(vars(module).items()):
            if callable(value) and _hashable(value) and value in replacements:
                setattr(module, name, replacements[value])
                used.add(value)
    return used
