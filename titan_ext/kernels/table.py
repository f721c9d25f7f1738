"""A kernel row: an fla function (or a transformers function calling one) and what titan_ext's own models call
instead. Each kernel module lists its rows (``KERNELS``) beside the functions they name, and the parameters of
the functions it replaces or calls by keyword as it was written against them (``SIGNATURES``); ``titan_ext.kernels``
gathers them from ``KERNEL_MODULES``. Not a change to any library: a bound model's modules get subclasses whose
methods see other globals (``binding``); fla's modules and classes stay as shipped."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Kernel:
    fla: str
    """``module:name`` of a function, a method (``module:Class.method``), or a class: a bound model then builds
    the replacement, a subclass of fla's, wherever fla's code names the class."""
    replacement: Callable
    why: str
    paths: tuple[str, ...] = ("portable",)
    """Kernel paths that use it: ``portable`` (any non-CUDA run), ``fla`` (CUDA)."""


TRITON = "Triton kernel; fails off CUDA with '0 active drivers'"
OPAQUE = (
    "fla's function, opaque to torch.compile: fla launches Triton behind torch.compiler.disable inside its autograd "
    "Functions, so a compiled block broke its graph there and compiled fla's wrappers as frames of their own, "
    "recompiled per dtype (seen on an H100)"
)
TP_LOCAL = (
    "under TP it receives DTensor shards of the conv weight/bias or A_log/dt_bias, which fla's Triton code cannot "
    "read: fla's function, called with each DTensor argument's local shard (a pass-through without TP), and opaque "
    "to torch.compile (as OPAQUE)"
)
