"""Per-block ``torch.compile`` for HF-layout decoders.

Each block is compiled (after AC wrapping, before FSDP, as torchtitan does).
The blocks share one code object and one structure, so dynamo traces one
frame and reuses it for every block: with ``inline_inbuilt_nn_modules`` (on
by default since torch 2.5) a block's parameters are graph inputs and
attributes it never reads in control flow (fla's integer ``layer_idx``:
only consulted when a KV cache is passed) install no guard. fla's
kernels sit behind ``torch.compiler.disable`` inside its autograd Functions;
titan_ext's models run every one a GLA, Gated DeltaNet or KDA block reaches as
a torch op (``titan_ext.kernels.gla_op``, ``kda_op``, ``gated_delta_op``,
``recurrent_gla_op``, ``norm_ops``, ``elementwise_ops``, ``conv_op``,
``rotary_op``), so each block compiles to one graph; the rotary caches are
filled before the blocks run (``rotary.fill_caches``). A graph break in a block
still compiles once for all blocks (``tests/test_ac_compile.py`` forces one).

A hybrid's blocks differ in their token mixer (``titan_ext.models.mixers``): one shared frame would
fail its guards on the mixer's type at every block of the other kind, a recompile per kind (and
past dynamo's cache limit, a fallback to eager). Each mixer kind's blocks get a forward of their own
(``_per_mixer_code``: the same function, its own code object), so dynamo traces each kind once and
reuses it for every block of that kind (and so the ``__call__`` or ``forward`` wrapper transformers puts
around every layer's ``forward``).

Embeddings (a gather), the final norm (already one fused kernel on CUDA)
and ``lm_head`` (one GEMM) leave nothing to fuse, so they stay eager. The
loss is torchtitan's: its ``build_cross_entropy_loss`` compiles it when
``loss`` is in ``--compile.components``.
"""

from __future__ import annotations

import logging
import types

import torch
import torch.nn as nn

from titan_ext.kernels.binding import holds

logger = logging.getLogger()


_per_mixer_classes: dict[tuple[type, str], type] = {}


def _per_mixer_code(cls: type, mixer: str) -> type:
    """``cls`` with a ``forward`` of its own code objects for the blocks of one mixer kind (dynamo keeps its
    compiled frames per code object), and its own ``__call__`` where the class defines one in Python
    (transformers < 5.24's layers do: dynamo's first frame is then that ``__call__``)."""
    if (cls, mixer) not in _per_mixer_classes:
        own = type(cls.__name__, (cls,), {"__module__": cls.__module__})
        for name in ("__call__", "forward"):  # set after the class is made: a class hook may wrap them (_own_code)
            fn = getattr(cls, name)
            if isinstance(fn, types.FunctionType) and fn is not nn.Module.__call__:
                setattr(own, name, _own_code(fn))
        _per_mixer_classes[cls, mixer] = own
    return _per_mixer_classes[cls, mixer]


def _own_code(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with a code object of its own, and so the functions it wraps.

    transformers >= 5.24 wraps each layer class's ``forward`` in a ``forward_with_checkpointing`` (a class
    hook, also on subclasses), one code object for every layer class: dynamo's frame is the wrapper's, and
    copying the wrapper alone left every kind on the shared inner ``forward``, a recompile per kind.
    The wrapped function (``__wrapped__``, held in the wrapper's closure) is copied too, and a wrapper that
    names itself (is it the outermost?) names its copy.
    """
    inner = fn.__dict__.get("__wrapped__")
    cells = fn.__closure__ or ()
    inner_copy = _own_code(inner) if isinstance(inner, types.FunctionType) and any(holds(c, inner) for c in cells) else None
    own_cells = tuple(types.CellType(inner_copy) if inner_copy is not None and holds(c, inner)
                      else types.CellType() if holds(c, fn) else c for c in cells)
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, own_cells or None)
    for cell, old in zip(own_cells, cells):
        if cell is not old and holds(old, fn):
            cell.cell_contents = copy
    copy.__kwdefaults__, copy.__qualname__, copy.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    copy.__dict__.update(fn.__dict__)
    if inner_copy is not None:
        copy.__wrapped__ = inner_copy
    return copy


def model_compile_enabled(job_config) -> bool:
    return job_config.compile.enable and "model" in job_config.compile.components


def apply_compile(model: nn.Module, backend: str) -> None:
    """Replace each decoder block with its compiled version (the compiled module is what runs)."""
    from titan_ext.kernels import rotary  # imports fla: only in a job that compiles

    layers = model.blocks()
    mixers = model.mixers
    hybrid = model.structure.hybrid
    for name, block in list(layers.named_children()):
        if hybrid:
            block.__class__ = _per_mixer_code(type(block), repr(mixers[int(name)]))
        # No fullgraph: an fla Triton op dynamo cannot trace must stay a graph break, not an error.
        layers.register_module(name, torch.compile(block, backend=backend))
    model.register_forward_pre_hook(rotary.fill_caches)
    logger.info(f"Compiled each of {len(layers)} blocks with torch.compile (backend {backend})")
