"""fla's kernels as the ``fla`` (CUDA) path calls them: under tensor parallelism on local shards, and,
where titan_ext has no torch op for one, opaque to torch.compile.

Local shards: TP (``model_plans.styles.PlaceParameters``) shards the parameters a kernel
reads directly, without a linear in between: ShortConvolution's weight and
bias, Gated DeltaNet's and KDA's per-head ``A_log``/``dt_bias``. They stay DTensors with
their global shape (meta-device build, init, DCP and FSDP see the whole
tensor), while the q/k/v reaching the kernel are the plain local tensors of
colwise projections. A kernel therefore takes each DTensor argument's local
shard: ``to_local()`` is differentiable and its gradient comes back as the
same shard. Without TP nothing is a DTensor and every call passes through.
The norms under TP get DTensor inputs too (``norm_on_local_shards``).

Torch ops: every fla kernel a GLA, Gated DeltaNet or KDA training block reaches runs as a
torch op with a fake implementation, fla's own drivers inside (``gla_op``, ``kda_op``,
``gated_delta_op``, ``recurrent_gla_op``, ``norm_ops``, ``elementwise_ops``, ``conv_op``,
``rotary_op``), so a compiled block is one graph. The wrappers here that call those ops
are traced by dynamo (the local-shard logic is plain DTensor code).

Opaque: the entry points left (decoding kernels, fla's fused-chunk GLA, the standalone
activations) launch Triton behind ``torch.compiler.disable`` deep inside fla's autograd
Functions (its backend dispatch). Traced from a compiled block, each call broke the graph
inside fla, and dynamo compiled fla's wrappers as frames of their own, guarded on every
call and recompiled per dtype (seen on an H100). They are therefore
``torch.compiler.disable``d as a whole: one graph break per call, fla's code untraced.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from fla.layers.gated_deltanet import GatedDeltaNet
from fla.modules.activations.ops import logsigmoid as fla_logsigmoid
from fla.modules.activations.ops import sigmoid as fla_sigmoid
from fla.modules.activations.ops import swish as fla_swish
from fla.modules.causal_conv1d.ops import causal_conv1d_update as fla_causal_conv1d_update
from fla.ops.gated_delta_rule.fused_recurrent import (
    fused_recurrent_gated_delta_rule as fla_fused_recurrent_gated_delta_rule,
)
from fla.ops.gla.fused_chunk import fused_chunk_gla as fla_fused_chunk_gla
from fla.ops.kda.fused_recurrent import fused_recurrent_kda as fla_fused_recurrent_kda
from torch.distributed.tensor import DTensor, Partial, Replicate

from titan_ext import compat
from titan_ext.kernels import norm_ops
from titan_ext.kernels.table import OPAQUE, TP_LOCAL, Kernel


def local(x):
    """This rank's shard of a DTensor (differentiable); anything else as is."""
    return x.to_local() if isinstance(x, DTensor) else x


def this_ranks_rows(weight, sizes: list[int]):
    """A replicated weight's rows of this rank's heads (``sizes``: its segments along dim 0, each split evenly
    across the TP ranks), its gradient summed over them; a plain weight (no TP) as it is."""
    if not isinstance(weight, DTensor):
        return weight
    mesh = weight.device_mesh
    whole = SumGradients.apply(weight.to_local(), mesh.get_group())
    return torch.cat([part.chunk(mesh.size())[mesh.get_local_rank()] for part in whole.split(sizes)])


class SumGradients(torch.autograd.Function):
    """The identity, its gradient summed over ``group``: each rank's gradient covers its own rows of a
    replicated weight, and the weight's gradient must be the whole (and equal on every rank)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def waiting_for_gradients(out):
    """``out`` (a tensor, or a tuple of tensors and None), each tensor that takes a gradient through
    ``compat.waited``: its gradient reaches the fla kernel's backward finished."""
    if isinstance(out, tuple):
        return tuple(waiting_for_gradients(y) for y in out)
    if isinstance(out, torch.Tensor) and out.requires_grad:
        return compat.waited(out)
    return out


def with_local_args(fn: Callable) -> Callable:
    """``fn`` called with each DTensor argument replaced by its local shard."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not any(isinstance(a, DTensor) for a in (*args, *kwargs.values())):
            return fn(*args, **kwargs)
        out = fn(*(local(a) for a in args), **{name: local(value) for name, value in kwargs.items()})
        return waiting_for_gradients(out)

    return call


def fla_entry(fn: Callable) -> Callable:
    """fla's ``fn`` as the fla path calls it: opaque to torch.compile, each DTensor argument as its local shard."""
    entry = torch.compiler.disable(with_local_args(fn))
    entry.__wrapped__ = fn  # what it calls, one step down (not the local-shard wrapper between)
    return entry


causal_conv1d_update = fla_entry(fla_causal_conv1d_update)
fused_chunk_gla = fla_entry(fla_fused_chunk_gla)
fused_recurrent_gated_delta_rule = fla_entry(fla_fused_recurrent_gated_delta_rule)
fused_recurrent_kda = fla_entry(fla_fused_recurrent_kda)
logsigmoid = fla_entry(fla_logsigmoid)
sigmoid = fla_entry(fla_sigmoid)
swish = fla_entry(fla_swish)


def norm_on_local_shards(fn: Callable) -> Callable:
    """An fla norm kernel under TP (``model_plans.styles.NormParallel``): its input arrives as a DTensor
    (sharded over the sequence or heads, or replicated) with replicated DTensor weights, which a
    Triton kernel cannot read. Normalising runs along the last dimension, never a sharded one, so
    fla's kernel runs on the local shards; the output gets the input's layout back, and a replicated
    weight's gradient is a partial sum over the ranks wherever the input is sharded."""

    @functools.wraps(fn)
    def call(x, *args, **kwargs):
        if not isinstance(x, DTensor):
            return fn(x, *args, **kwargs)
        mesh, layout = x.device_mesh, x.placements
        weight_grads = tuple(Partial() if p.is_shard() else Replicate() for p in layout)

        def unwrap(a):
            if not isinstance(a, DTensor):
                return a
            shard = a.to_local() if a.placements == layout else a.to_local(grad_placements=weight_grads)
            return compat.waited(shard)  # a redistribution's result may still be in flight: Triton reads memory

        out = waiting_for_gradients(fn(unwrap(x), *(unwrap(a) for a in args), **{name: unwrap(v) for name, v in kwargs.items()}))
        wrap = lambda y: DTensor.from_local(y, mesh, layout, run_check=False) if y is not None else y  # noqa: E731
        return tuple(wrap(y) for y in out) if isinstance(out, tuple) else wrap(out)

    return call


rms_norm = norm_on_local_shards(norm_ops.rms_norm)
rms_norm_gated = norm_on_local_shards(norm_ops.rms_norm_gated)


def use_fused_qkv_conv(self: GatedDeltaNet, *args, **kwargs) -> bool:
    """fla's choice, except with sharded conv weights: the fused path concatenates the three
    weights (a DTensor cat gathers them whole) and splits its output by global widths, while
    the q/k/v it convolves are local, so each conv runs alone on its own shard."""
    if self.use_short_conv and isinstance(self.q_conv1d.weight, DTensor):
        return False
    return GatedDeltaNet._use_fused_qkv_conv(self, *args, **kwargs)


KERNELS = (
    Kernel("fla.ops.gla.fused_chunk:fused_chunk_gla", fused_chunk_gla, OPAQUE, ("fla",)),
    Kernel("fla.modules.activations.ops:swish", swish, OPAQUE, ("fla",)),
    Kernel("fla.modules.activations.ops:sigmoid", sigmoid, OPAQUE, ("fla",)),
    Kernel("fla.modules.activations.ops:logsigmoid", logsigmoid, OPAQUE, ("fla",)),
    Kernel("fla.modules.causal_conv1d.ops:causal_conv1d_update", causal_conv1d_update, TP_LOCAL, ("fla",)),
    Kernel(
        "fla.ops.gated_delta_rule.fused_recurrent:fused_recurrent_gated_delta_rule", fused_recurrent_gated_delta_rule,
        TP_LOCAL,
        ("fla",),
    ),
    Kernel("fla.ops.kda.fused_recurrent:fused_recurrent_kda", fused_recurrent_kda, TP_LOCAL, ("fla",)),
    Kernel(
        "fla.modules.norm.layernorm:rms_norm", rms_norm,
        "fla's norm as torch ops around fla's own drivers (norm_ops: compile keeps it in the block's graph); "
        "under TP (sequence parallel, or the per-head output norm) its input is a DTensor and its weight a "
        "replicated DTensor, which fla's Triton kernel cannot read: the ops on the local shards, the output "
        "rewrapped (found under Triton's interpreter)",
        ("fla",),
    ),
    Kernel(
        "fla.modules.norm.fused_norm_gate:rms_norm_gated", rms_norm_gated,
        "the same, for the gated output norm (GLA's g_norm, Gated DeltaNet's and KDA's o_norm)",
        ("fla",),
    ),
    Kernel(
        "fla.layers.gated_deltanet:GatedDeltaNet._use_fused_qkv_conv", use_fused_qkv_conv,
        "under TP its fused path concatenates the three sharded conv weights (a DTensor cat gathers them "
        "whole) and splits by global widths while q/k/v are local: False for DTensor conv weights (each conv "
        "runs on its shard), else fla's choice",
        ("portable", "fla"),
    ),
)
"""What titan_ext's models call instead of fla's functions (``kernels.replacements``)."""

SIGNATURES = {
    "fla.layers.gated_deltanet:GatedDeltaNet._use_fused_qkv_conv": "self, last_state, use_cache, cu_seqlens",
}
"""Parameters (``name=default``) of the functions replaced or called by keyword, as written against them
(``host.checks.check_fla_signatures``)."""
