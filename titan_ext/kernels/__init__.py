"""Portable (non-CUDA) kernels for fla: ``install()`` routes fla's Triton ops to torch off CUDA.

(It also turns ``chunk_gla`` into torch ops on every device; why is in ``gla_op``.)

fla 0.6 imports on a machine without a GPU, but a GLA model's forward reaches
Triton (GLA ops, RMSNorm, gated norm, swish, swiglu, rotary embedding, short
convolution, fused cross entropy) and fails with ``0 active drivers``. ``install()`` rebinds those
names inside the fla modules that call them to small wrappers which, per call,
look at the first tensor argument: CUDA tensors go to fla's original function,
untouched; anything else (CPU, or a DTensor whose device is not CUDA) goes to
the torch implementation in this package. The torch code is plain
differentiable ops, so autograd, DTensor and ``torch.compile`` just work.

Why not fla's backend registry (``fla/backends.py``)? It looked like the
natural hook (backends register per function, a verifier can accept by
device), but it is not a clean one for this:

* it swaps *internal* helpers inside fla's hand-written
  ``torch.autograd.Function``\\ s (``layer_norm_fwd``/``layer_norm_bwd``,
  ``swiglu_fwd``/``swiglu_fwdbwd``, ``chunk_gla_fwd_intra_gk``...), so a torch
  backend would have to reproduce fla's private forward/backward buffers
  (``rstd``, ``g_cumsum``, ``A``...) instead of letting autograd differentiate;
* public entry points are not dispatched at all: ``chunk_gla`` (which also
  calls Triton utilities outside the registry), ``fused_recurrent_gla``,
  ``fused_chunk_gla``, and ``FusedCrossEntropyLoss.forward`` asserts CUDA
  before reaching any hook;
* every dispatched call is wrapped in ``torch.compiler.disable`` (a graph
  break), and ``FLA_DISABLE_BACKEND_DISPATCH=1`` silently turns it off.

Rebinding therefore happens at the public-function level (see ``_TARGETS``;
``chunk_gla``, the training path, is rebound to ``gla_op``'s torch ops instead):
every ``fla.*`` module attribute (and ``ACT2FN`` entry) that *is* one of the
original functions gets the wrapper, and later ``from fla... import name``
imports pick the wrapper up. Objects that already copied a function before
``install()`` keep it (e.g. a ``GatedLinearAttention.gate_fn`` built earlier),
so call ``install()`` before building models; ``titan_ext`` does so on import.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable

import torch

from titan_ext.kernels import activations, conv, gla, gla_op, losses, norms, rotary

__all__ = ["device_dispatch", "install", "is_installed", "uninstall", "uses_portable_path"]

# (module defining the original, attribute, torch implementation); an attribute
# "Class.method" patches a method on that class. fla's chunk_gla (the training
# path) is not here: it becomes torch ops on every device (``gla_op``).
_TARGETS: list[tuple[str, str, Callable]] = [
    ("fla.ops.gla.fused_chunk", "fused_chunk_gla", gla.fused_chunk_gla),
    ("fla.ops.gla.fused_recurrent", "fused_recurrent_gla", gla.fused_recurrent_gla),
    ("fla.modules.norm.layernorm", "rms_norm", norms.rms_norm),
    ("fla.modules.norm.fused_norm_gate", "rms_norm_gated", norms.rms_norm_gated),
    ("fla.modules.activations.ops", "swish", activations.swish),
    ("fla.modules.activations.ops", "sigmoid", activations.sigmoid),
    ("fla.modules.activations.ops", "logsigmoid", activations.logsigmoid),
    ("fla.modules.activations.ops", "swiglu", activations.swiglu),
    ("fla.modules.activations.ops", "swiglu_linear", activations.swiglu_linear),
    ("fla.modules.rotary.ops", "rotary_embedding", rotary.rotary_embedding),
    ("fla.modules.causal_conv1d.ops", "causal_conv1d", conv.causal_conv1d),
    ("fla.modules.causal_conv1d.ops", "causal_conv1d_update", conv.causal_conv1d_update),
    ("fla.modules.fused_cross_entropy.ops", "cross_entropy_loss", losses.cross_entropy_loss),
    ("fla.modules.fused_cross_entropy.ops", "FusedCrossEntropyLoss.forward", losses.fused_cross_entropy_forward),
    (
        "fla.modules.fused_linear_cross_entropy.ops",
        "fused_linear_cross_entropy_loss",
        losses.fused_linear_cross_entropy_loss,
    ),
]

# (container, key, original) for every rebinding, so uninstall() can undo them
_rebound: list[tuple[object, str, Callable]] = []


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def uses_portable_path(tensor: torch.Tensor | None) -> bool:
    """True when a call with this leading tensor should take the torch path (anything not on CUDA)."""
    return tensor is not None and tensor.device.type != "cuda"


def device_dispatch(original: Callable, portable: Callable) -> Callable:
    """Wrap ``original`` so calls whose first tensor argument is not on CUDA run ``portable``.

    Calls without a tensor, or with a CUDA tensor, go to ``original`` with the
    same arguments. The wrapper takes the original's name, docstring and
    ``__wrapped__``, but not its ``__dict__``, so no decorator state of the
    original (e.g. from ``torch.compiler.disable``) leaks onto the wrapper.
    """

    def wrapper(*args, **kwargs):
        if uses_portable_path(_first_tensor(args, kwargs)):
            return portable(*args, **kwargs)
        return original(*args, **kwargs)

    names = ("__module__", "__name__", "__qualname__", "__doc__")
    functools.update_wrapper(wrapper, original, assigned=names, updated=())
    wrapper._titan_ext_original = original
    wrapper._titan_ext_portable = portable
    return wrapper


def _fla_modules():
    return [m for name, m in list(sys.modules.items()) if m is not None and (name == "fla" or name.startswith("fla."))]


def _rebind(container, key, original, wrapper):
    if isinstance(container, dict):
        container[key] = wrapper
    else:
        setattr(container, key, wrapper)
    _rebound.append((container, key, original))


def is_installed() -> bool:
    return bool(_rebound)


def install() -> None:
    """Route fla's Triton-backed ops to torch for non-CUDA tensors (idempotent)."""
    if is_installed():
        return
    importlib.import_module("fla.layers.gla")  # loads fla.modules/ops/models; the scan below sees every alias
    from fla.modules.activations import ACT2FN

    modules = _fla_modules()

    def rebind_everywhere(original, wrapper):
        for module in modules:
            for key, value in list(vars(module).items()):
                if value is original:
                    _rebind(module, key, original, wrapper)
        for key, value in list(ACT2FN.items()):
            if value is original:
                _rebind(ACT2FN, key, original, wrapper)

    for module_name, attr, portable in _TARGETS:
        owner = importlib.import_module(module_name)
        if "." in attr:  # a method, e.g. FusedCrossEntropyLoss.forward
            cls_name, method = attr.split(".")
            cls = getattr(owner, cls_name)
            original = cls.__dict__[method]
            _rebind(cls, method, original, device_dispatch(original, portable))
            continue
        original = getattr(owner, attr)
        rebind_everywhere(original, device_dispatch(original, portable))

    original = importlib.import_module("fla.ops.gla.chunk").chunk_gla
    rebind_everywhere(original, gla_op.as_torch_op(original, fallback=device_dispatch(original, gla.chunk_gla)))


def uninstall() -> None:
    """Restore every name ``install()`` rebound."""
    while _rebound:
        container, key, original = _rebound.pop()
        if isinstance(container, dict):
            container[key] = original
        else:
            setattr(container, key, original)
