"""Per-block ``torch.compile`` for HF-layout decoders.

Each block is compiled (after AC wrapping, before FSDP, as torchtitan does).
The blocks share one code object and one structure, so dynamo traces one
frame and reuses it for every block: with ``inline_inbuilt_nn_modules`` (on
by default since torch 2.5) a block's parameters are graph inputs and
attributes it never reads in control flow (fla's integer ``layer_idx``:
only consulted when a KV cache is passed) install no guard. fla's
``chunk_gla`` and ``chunk_kda`` sit behind ``torch.compiler.disable``;
titan_ext's models run them as torch ops (``titan_ext.kernels.gla_op``,
``kda_op``), so the GLA and KDA cores stay inside the block's graph instead
of splitting it. fla's other kernels (norms, SwiGLU, rotary, convolutions) are
called opaque (``kernels.tp_local``): a graph break at each call, never a
dynamo frame inside fla or Triton. A graph break in a block
still compiles once for all blocks (``tests/test_ac_compile.py`` forces one).

A hybrid's blocks differ in their token mixer (``titan_ext.models.mixers``): one shared frame would
fail its guards on the mixer's type at every block of the other kind, a recompile per kind (and
past dynamo's cache limit, a fallback to eager). Each mixer kind's blocks get a forward of their own
(``_per_mixer_code``: the same function, its own code object), so dynamo traces each kind once and
reuses it for every block of that kind.

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

logger = logging.getLogger()


_per_mixer_classes: dict[tuple[type, str], type] = {}


def _per_mixer_code(cls: type, mixer: str) -> type:
    """``cls`` with a ``forward`` of its own code object for the blocks of one mixer kind (dynamo keeps its
    compiled frames per code object)."""
    if (cls, mixer) not in _per_mixer_classes:
        fn = cls.forward
        forward = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        forward.__kwdefaults__, forward.__qualname__, forward.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
        forward.__dict__.update(fn.__dict__)
        _per_mixer_classes[cls, mixer] = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
    return _per_mixer_classes[cls, mixer]


def model_compile_enabled(job_config) -> bool:
    return job_config.compile.enable and "model" in job_config.compile.components


def apply_compile(model: nn.Module, backend: str) -> None:
    """Replace each decoder block with its compiled version (the compiled module is what runs)."""
    layers = model.get_decoder().layers
    mixers = getattr(model, "mixers", ())
    hybrid = len({type(mixer) for mixer in mixers}) > 1
    for name, block in list(layers.named_children()):
        if hybrid:
            block.__class__ = _per_mixer_code(type(block), type(mixers[int(name)]).__name__)
        # No fullgraph: an fla Triton op dynamo cannot trace must stay a graph break, not an error.
        layers.register_module(name, torch.compile(block, backend=backend))
    logger.info(f"Compiled each of {len(layers)} blocks with torch.compile (backend {backend})")
