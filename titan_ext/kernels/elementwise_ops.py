"""fla's SwiGLU as two torch ops, fla's drivers inside (the ``fla`` kernel path), and fla's fused
SwiGLU-then-linear on them.

fla's ``swiglu_linear`` (GLA's and the delta rules' MLP with ``fuse_swiglu``) is an autograd
Function of a Triton launch and a GEMM: called opaque, each MLP broke a compiled block's graph.
Here ``swish(x) * y`` is ``torch.ops.titan_ext.swiglu_fwd`` (fla's ``swiglu_fwd``) with
``titan_ext::swiglu_bwd`` (fla's ``swiglu_fwdbwd``) as its gradient, and the linear is
``F.linear`` in the graph. fla's Function recomputes ``swish(x) * y`` in backward to save
memory; here that is the AC policy's choice (no ``SAVE_LIST``: op-level SAC recomputes it,
as fla does). Under TP the inputs and ``down_proj``'s weight arrive as DTensors
(fla's ``SwiGLULinearParallel``): each rank multiplies its shards, a partial sum rewrapped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial

from titan_ext import compat
from titan_ext.kernels.op_parts import fresh
from titan_ext.kernels.table import Kernel


@torch.library.custom_op("titan_ext::swiglu_fwd", mutates_args=())
def swiglu_fwd(x: Tensor, y: Tensor) -> Tensor:
    return compat.fla_block_drivers().swiglu_fwd(x=x, y=y, output_contiguous=True)


@swiglu_fwd.register_fake
def _(x, y):
    return fresh(x)


@torch.library.custom_op("titan_ext::swiglu_bwd", mutates_args=())
def swiglu_bwd(x: Tensor, y: Tensor, dz: Tensor) -> tuple[Tensor, Tensor]:
    dx, dy = compat.fla_block_drivers().swiglu_fwdbwd(x=x, y=y, g=dz, output_contiguous=True)
    return dx, dy


@swiglu_bwd.register_fake
def _(x, y, dz):
    return fresh(x), fresh(y)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dz):
    return torch.ops.titan_ext.swiglu_bwd(*ctx.saved_tensors, dz)


swiglu_fwd.register_autograd(_backward, setup_context=_setup_context)


def swiglu(x, y):
    """fla's ``swiglu`` (``swish(x) * y``) through ``titan_ext::swiglu_fwd``/``bwd``."""
    return torch.ops.titan_ext.swiglu_fwd(x, y)


def swiglu_linear(x, y, weight, bias):
    """fla's ``swiglu_linear``: ``swiglu(x, y) @ weight.T + bias``, the linear in the graph; under TP
    (DTensor weight) on each rank's shards, a partial sum rewrapped and the bias added once, by DTensor."""
    if not isinstance(weight, DTensor):
        return F.linear(swiglu(x, y), weight, bias)
    shards = [compat.waited(a.to_local() if isinstance(a, DTensor) else a) for a in (x, y, weight)]
    out = DTensor.from_local(F.linear(swiglu(shards[0], shards[1]), shards[2]), weight.device_mesh, (Partial(),),
                             run_check=False)
    return out if bias is None else out + bias


KERNELS = (
    Kernel("fla.modules.activations.ops:swiglu", swiglu,
           "a Triton autograd.Function, opaque to compile (a graph break per call): as torch ops around fla's "
           "own drivers, kept in the compiled graph", ("fla",)),
    Kernel("fla.modules.activations.ops:swiglu_linear", swiglu_linear,
           "fla's SwiGLU-then-GEMM Function (a graph break per MLP; under TP fla's SwiGLULinearParallel hands it "
           "DTensors, which its Triton kernel cannot read): fla's SwiGLU as torch ops, the linear in the graph, "
           "on local shards under TP", ("fla",)),
)
"""What titan_ext's models call instead of fla's functions (``kernels.replacements``)."""

SIGNATURES = {
    "fla.modules.activations.ops:swiglu_fwd": "x, y, output_contiguous=False",
    "fla.modules.activations.ops:swiglu_fwdbwd":
        "x, y, g, use_weight=False, output_contiguous=False",
    "fla.modules.activations.ops:swiglu_linear": "x, y, weight, bias",
}
"""Parameters (``name=default``) of the functions replaced or called by keyword, as written against them
(``host.checks.check_fla_signatures``)."""
