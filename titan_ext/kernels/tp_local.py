"""fla's kernels under tensor parallelism: parameters arrive as DTensor shards, activations as local tensors.

TP (``model_plans.styles.PlaceParameters``) shards the parameters a kernel
reads directly, without a linear in between: ShortConvolution's weight and
bias, Gated DeltaNet's per-head ``A_log``/``dt_bias``. They stay DTensors with
their global shape (meta-device build, init, DCP and FSDP see the whole
tensor), while the q/k/v reaching the kernel are the plain local tensors of
colwise projections. A kernel therefore takes each DTensor argument's local
shard: ``to_local()`` is differentiable and its gradient comes back as the
same shard. Without TP nothing is a DTensor and every call passes through.

The portable kernels call ``local`` themselves; on the ``fla`` (CUDA) path
the wrappers below give fla's own functions local shards, unchanged otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from fla.layers.gated_deltanet import GatedDeltaNet
from fla.modules.causal_conv1d.ops import causal_conv1d as fla_causal_conv1d
from fla.modules.causal_conv1d.ops import causal_conv1d_update as fla_causal_conv1d_update
from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule as fla_chunk_gated_delta_rule
from fla.ops.gated_delta_rule.fused_recurrent import (
    fused_recurrent_gated_delta_rule as fla_fused_recurrent_gated_delta_rule,
)
from torch.distributed.tensor import DTensor


def local(x):
    """This rank's shard of a DTensor (differentiable); anything else as is."""
    return x.to_local() if isinstance(x, DTensor) else x


def with_local_args(fn: Callable) -> Callable:
    """``fn`` called with each DTensor argument replaced by its local shard."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return fn(*(local(a) for a in args), **{name: local(value) for name, value in kwargs.items()})

    return call


causal_conv1d = with_local_args(fla_causal_conv1d)
causal_conv1d_update = with_local_args(fla_causal_conv1d_update)
chunk_gated_delta_rule = with_local_args(fla_chunk_gated_delta_rule)
fused_recurrent_gated_delta_rule = with_local_args(fla_fused_recurrent_gated_delta_rule)


def use_fused_qkv_conv(self: GatedDeltaNet, *args, **kwargs) -> bool:
    """fla's choice, except with sharded conv weights: the fused path concatenates the three
    weights (a DTensor cat gathers them whole) and splits its output by global widths, while
    the q/k/v it convolves are local, so each conv runs alone on its own shard."""
    if self.use_short_conv and isinstance(self.q_conv1d.weight, DTensor):
        return False
    return GatedDeltaNet._use_fused_qkv_conv(self, *args, **kwargs)
