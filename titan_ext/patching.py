"""How titan_ext changes the libraries it runs inside: the kinds of row, applying them, and undoing them all.

``import titan_ext`` changes none of them. Every change titan_ext makes to fla, torchtitan, transformers or
torch is one row of a table in one of ``TABLE_MODULES`` (each beside the code it serves): the target, why,
the versions it was checked against, and how it is undone. ``rows()`` lists them all; ``undo()`` restores
every original applied in this process. This module holds no table: anyone may import it (a leaf beside
``compat``). Not here, since it changes no library: the kernels titan_ext's own models call instead of fla's
(each kernel module's ``KERNELS``, ``titan_ext.kernels``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from titan_ext.compat import owner_and_name, resolve

TORCHTITAN = "torchtitan 0.2.2"
FLA = "fla 0.6.0"
TORCH = "torch 2.11-2.15"
TRITON = "triton 3.6-3.9"

TABLE_MODULES = (
    "titan_ext.host.cpu_patches",
    "titan_ext.host.job_patches",
    "titan_ext.parallel.host_patches",
    "titan_ext.checkpoints.host_patches",
    "titan_ext.kernels.host_patches",
    "titan_ext.planner.host_patches",
)
"""Every module holding a table of changes to a host library; each lists its tables in ``TABLES``."""


@dataclass(frozen=True)
class Patch:
    target: str
    """``module:attribute`` or ``module:Class.attribute``."""
    why: str
    checked: str
    new: Callable[[object], object]
    """The original -> what the target becomes."""

    def owner_and_name(self) -> tuple[object, str]:
        return owner_and_name(self.target)

    def apply(self) -> Callable[[], None]:
        """Rebind the target; returns the undo (restores the original object, or a method the class
        inherits by deleting the class's own)."""
        owner, name = self.owner_and_name()
        if isinstance(owner, type) and name not in vars(owner):
            setattr(owner, name, self.new(getattr(owner, name)))
            return lambda: delattr(owner, name)
        original = resolve(self.target)
        setattr(owner, name, self.new(original))
        return lambda: setattr(owner, name, original)


@dataclass(frozen=True)
class Setting:
    """A flag of a host library that an ``apply_*`` sets for its job, as torchtitan's own ``apply_*`` do;
    ``undo()`` restores it."""

    target: str
    why: str
    checked: str

    def set(self, value, setter: Callable[[object], None] | None = None) -> None:
        """Set the flag (through the library's own ``setter`` where it has one)."""
        owner, name = owner_and_name(self.target)
        original = getattr(owner, name)
        (setter or (lambda v: setattr(owner, name, v)))(value)
        _undo_stack.append(lambda: setattr(owner, name, original))


@dataclass(frozen=True)
class InstancePatch:
    """A method or attribute of one object torchtitan builds for a job: the change ends with the object."""

    target: str
    """``module:Class.attribute``: the class of the objects it applies to."""
    why: str
    checked: str

    def apply(self, instance, new: Callable[[object], object]) -> None:
        """``new(original) -> replacement`` on this one instance."""
        module, _, path = self.target.partition(":")
        class_name, _, name = path.rpartition(".")
        if not _instance_of(instance, module, class_name):
            raise TypeError(f"{self.target}: {type(instance).__name__} is not a {class_name}")
        setattr(instance, name, new(getattr(instance, name)))


Row = Patch | Setting | InstancePatch


def _instance_of(instance, module: str, class_name: str) -> bool:
    """Whether ``instance`` is a ``module:class_name``, the class found by its file (``torchrun -m
    torchtitan.train`` runs train.py as ``__main__``: its Trainer is not ``torchtitan.train``'s)."""
    origin = importlib.util.find_spec(module).origin
    return any(klass.__name__ == class_name and getattr(sys.modules.get(klass.__module__), "__file__", None) == origin
               for klass in type(instance).__mro__)


def table_modules() -> list[types.ModuleType]:
    """``TABLE_MODULES``, imported (by name: they import this module)."""
    return [importlib.import_module(name) for name in TABLE_MODULES]


def rows() -> list[Row]:
    """Every row of every table, in ``TABLE_MODULES`` order."""
    return [row for module in table_modules() for table in module.TABLES for row in table]


_undo_stack: list[Callable[[], None]] = []
_applied: set[int] = set()
"""The tables applied in this process (by identity), until ``undo()``."""


def first_time(table: object) -> bool:
    """Whether ``table`` is applied for the first time in this process (a process may run several jobs: a
    bench, the integration matrix); from now on it counts as applied, until ``undo()``."""
    if id(table) in _applied:
        return False
    _applied.add(id(table))
    return True


def on_undo(restore: Callable[[], None]) -> None:
    """``restore`` runs at ``undo()``, after every change made since, before every change made earlier."""
    _undo_stack.append(restore)


def apply(patches: tuple[Patch, ...]) -> None:
    """Apply rows of a table; ``undo()`` reverts them, last first."""
    for patch in patches:
        _undo_stack.append(patch.apply())


def apply_once(patches: tuple[Patch, ...]) -> None:
    """A table's rows, once per process."""
    if first_time(patches):
        apply(patches)


class DropMessages(logging.Filter):
    """A logger's records whose message contains any of ``parts`` are dropped."""

    def __init__(self, *parts: str):
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(part in message for part in self.parts)


def quiet(messages: list[str], logs: list[tuple[str, str]]) -> None:
    """Drop these warnings (message regexes) and log records (logger, message part); ``undo()`` restores them."""
    for message in messages:
        warnings.filterwarnings("ignore", message=message)
        _undo_stack.append(lambda m=message: _remove_warning_filter(m))
    for name, part in logs:
        log_filter = DropMessages(part)
        logging.getLogger(name).addFilter(log_filter)
        _undo_stack.append(lambda n=name, f=log_filter: logging.getLogger(n).removeFilter(f))


def _remove_warning_filter(message: str) -> None:
    warnings.filters[:] = [f for f in warnings.filters if not (f[0] == "ignore" and f[1] is not None and f[1].pattern == message)]


def undo() -> None:
    while _undo_stack:
        _undo_stack.pop()()
    _applied.clear()


def active() -> bool:
    return bool(_undo_stack)


@contextlib.contextmanager
def scoped(patches: tuple[Patch, ...]) -> Iterator[None]:
    """Rows applied for one ``with`` block; restored right after, last first."""
    undos = [patch.apply() for patch in patches]
    try:
        yield
    finally:
        for undo_one in reversed(undos):
            undo_one()
