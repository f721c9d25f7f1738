"""Which kernels titan_ext's fla models call: fla's as shipped, or torch-native ones off CUDA.

Each kernel module lists what it replaces (``KERNELS``, rows of ``table.Kernel``) and the
signatures it was written against (``SIGNATURES``); ``KERNEL_MODULES`` names those modules, and
``replacements`` gathers their rows. A job picks a kernel path once (``titan_ext.job_plan.JobPlan.kernel_path``):

* ``fla`` (CUDA): fla's kernels, every one a GLA, Gated DeltaNet or KDA training
  block reaches as torch ops
  around fla's own drivers (``gla_op``, ``kda_op``, ``gated_delta_op``, ``recurrent_gla_op``, ``norm_ops``, ``elementwise_ops``,
  ``conv_op``, ``rotary_op``: op-level SAC, and one compiled graph per block),
  and the rotary cache check (``rotary``); fla's decoding kernels and standalone
  activations are called opaque to torch.compile (``tp_local``: one graph break,
  fla's code untraced);
* ``portable`` (anything else): every Triton entry point a GLA, Gated DeltaNet or transformer
  model reaches runs torch code (``gla``, ``norms``, ``activations``, ...):
  plain differentiable ops, so autograd, DTensor and compile just work.

``bind(model, path)`` applies a path to one model (``binding``): fla's modules
and classes are never changed. ``portable(model)`` is the public entry point
for running an fla model on a machine without a GPU (``titan_ext.pretrained.from_pretrained``
loads one, e.g. titan_ext's HF export, and makes it portable).

Why not fla's backend registry (``fla/backends.py``)? It swaps *internal*
helpers inside fla's hand-written autograd Functions (a torch backend would
have to reproduce fla's private forward/backward buffers instead of letting
autograd differentiate), leaves public entry points (``chunk_gla``,
``fused_recurrent_gla``, ``FusedCrossEntropyLoss.forward``) undispatched, and
wraps every dispatched call in ``torch.compiler.disable``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import types
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn

from titan_ext.compat import resolve
from titan_ext.kernels.binding import bind as _bind, hub_implementation
from titan_ext.kernels.table import Kernel

PATHS = ("fla", "portable")

KERNEL_MODULES = (
    "activations", "conv", "conv_op", "delta_rule", "delta_rule_op", "elementwise_ops", "gated_delta",
    "gated_delta_op", "gla", "gla_op", "kda", "kda_op", "layer_cache", "losses", "norm_ops", "norms",
    "recurrent_gla_op", "rotary", "rotary_op", "simple_gla", "tp_local", "transformers_gated_deltanet",
    "transformers_kda", "transformers_lightning", "transformers_short_conv",
)
"""The modules of ``titan_ext.kernels`` with ``KERNELS``, ``SIGNATURES`` or ``SAVE_LIST`` (torch ops whose outputs
op-level SAC keeps): a new one is one entry here."""

__all__ = ["KERNEL_MODULES", "PATHS", "bind", "default_path", "kernel_rows", "portable",
           "replacements", "sac_save_list", "signatures", "unported"]


def _kernel_modules() -> list:
    return [importlib.import_module(f"{__name__}.{name}") for name in KERNEL_MODULES]


@functools.cache
def kernel_rows() -> tuple[Kernel, ...]:
    """Every kernel module's ``KERNELS``."""
    return tuple(row for module in _kernel_modules() for row in getattr(module, "KERNELS", ()))


@functools.cache
def signatures() -> dict[str, str | tuple[str, ...]]:
    """Every kernel module's ``SIGNATURES``: ``module:name`` -> its parameters as written against (or the
    accepted ones, a tuple)."""
    return {target: params for module in _kernel_modules() for target, params in getattr(module, "SIGNATURES", {}).items()}


def sac_save_list() -> set:
    """Every kernel module's ``SAVE_LIST``."""
    return {op for module in _kernel_modules() for op in getattr(module, "SAVE_LIST", ())}


@functools.cache
def replacements(path: str) -> dict[object, Callable]:
    """fla object -> titan_ext's replacement, for one kernel path."""
    if path not in PATHS:
        raise ValueError(f"unknown kernel path {path!r}; one of {PATHS}")
    return {resolve(k.fla): k.replacement for k in kernel_rows() if path in k.paths}


@functools.cache
def global_names(path: str) -> dict[str, dict[str, object]]:
    """Names an fla module leaves empty without an optional package, and what a bound model sees instead.

    fla's ``Attention`` calls ``flash_attn_func``, None when flash-attn is not
    installed: titan_ext's models run PyTorch SDPA behind flash-attn's API.
    """
    from titan_ext.kernels import sdpa_attention

    if sdpa_attention.flash_attn_available():
        return {}
    return {"fla.layers.attn": {"flash_attn_func": sdpa_attention.sdpa_attn_func,
                                "flash_attn_varlen_func": sdpa_attention.sdpa_attn_varlen_func}}


def default_path() -> str:
    """The path of a model built outside a planned job (a script's, a test's): fla's kernels on CUDA unless
    CPU mode is forced, titan_ext's portable ones elsewhere."""
    from titan_ext import cpu_mode

    return "fla" if torch.cuda.is_available() and not cpu_mode.forced() else "portable"


def bind(model: nn.Module, path: str, training: bool = False, forwards: dict | None = None) -> nn.Module:
    """Make ``model`` (in place) run the kernels of ``path`` (``training``: as a model titan_ext trains);
    returns it. ``forwards``: a module class's ``forward`` -> the one titan_ext's training models run instead
    (a mixer's ``training_forward``), itself seeing the path's kernels."""
    chosen = {**replacements(path), **(forwards or {})}
    _bind(model, chosen, f"{path}:training" if training else path, global_names(path))
    return model


def portable(model: nn.Module) -> nn.Module:
    """Run an fla model on CPU (or any non-CUDA device): torch code for every Triton kernel it reaches.

    ``model = titan_ext.kernels.portable(AutoModelForCausalLM.from_pretrained(path))``
    then ``model.generate(...)`` works without a GPU. Only this model changes.
    """
    return bind(model, "portable")


def unported(model: nn.Module) -> dict[str, str]:
    """fla kernels a bound model's blocks still call, each with the method that calls it.

    Read from the code, not run: the global names each block module's methods
    read that hold a function of ``fla.ops`` (fla's Triton kernels; its
    ``utils`` are torch code). A kernel titan_ext replaces is no longer there
    once ``bind`` ran, so on the portable path what remains needs a GPU.
    Decorated methods are read through (transformers >= 5.2x wraps each
    layer's ``forward`` in a checkpointing closure whose code names no kernel),
    and so are transformers' hub wrappers (a modeling file's global such as
    ``torch_chunk_gated_delta_rule`` calls fla's kernel from its closure:
    ``binding.hub_implementation``).
    """
    found, read = {}, set()
    stacks = [child for child in model.get_decoder().children() if isinstance(child, nn.ModuleList)]
    for module in (m for stack in stacks for m in stack.modules()):
        cls = type(module)
        if cls in read:  # the blocks' modules share their classes: each class read once
            continue
        read.add(cls)
        for name in dir(cls):
            method = inspect.getattr_static(cls, name, None)
            if not isinstance(method, types.FunctionType):
                continue
            for fn in functions_run(method):
                for global_name in fn.__code__.co_names:
                    value = fn.__globals__.get(global_name)
                    value = hub_implementation(value) or value  # transformers' hub wrapper: what it calls
                    where = getattr(value, "__module__", None) or ""
                    if callable(value) and where.startswith("fla.ops.") and not where.startswith("fla.ops.utils"):
                        kernel = f"{where}.{value.__qualname__}"
                        if _reachable(kernel, model.config):
                            found.setdefault(kernel, f"{cls.__qualname__}.{name}")
    return found


def functions_run(method: types.FunctionType) -> Iterator[types.FunctionType]:
    """``method`` and the functions its decorators wrap, each with the globals it runs with.

    A ``binding.rebased`` copy shares its original's code and replaces it: the
    original's globals never run, so the chain skips it.
    """
    fn = method
    while isinstance(fn, types.FunctionType):
        yield fn
        inner = getattr(fn, "__wrapped__", None)
        while isinstance(inner, types.FunctionType) and inner.__code__ is fn.__code__:
            inner = getattr(inner, "__wrapped__", None)
        fn = inner


# Kernels a block calls only when its config turns a feature on: the option that does.
_KERNEL_OPTIONS = {"fla.ops.attnres.fused.fused_attnres": "attnres_block_size"}


def _reachable(kernel: str, config) -> bool:
    option = _KERNEL_OPTIONS.get(kernel)
    return option is None or getattr(config, option, None) is not None
