"""fla's causal convolution (``ShortConvolution``'s kernel) as two torch ops, fla's drivers inside (the
``fla`` kernel path).

fla's ``causal_conv1d`` runs ``CausalConv1dFunction``, Triton launches a compiled block could only call
opaque: a graph break per short convolution (KDA's q, k and v; Gated DeltaNet's). Here it is
``torch.ops.titan_ext.causal_conv1d_fwd`` with ``titan_ext::causal_conv1d_bwd`` as its gradient: fla's
``causal_conv1d_fwd``/``bwd``, as the Function calls them, so ``ShortConvolution.forward`` itself stays in
the graph. What the ops do not take (fla's context parallelism ``cp_context``, the CUDA and mixed
backends) goes to fla's ``causal_conv1d`` as shipped. Under TP the conv weight and bias arrive as DTensor
shards: their local shards (``tp_local.with_local_args``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fla.modules.causal_conv1d.ops import causal_conv1d as fla_causal_conv1d

from titan_ext import compat
from titan_ext.kernels import op_parts
from titan_ext.kernels.op_parts import empty, fresh, present
from titan_ext.kernels.table import TP_LOCAL, Kernel
from titan_ext.kernels.tp_local import with_local_args


@torch.library.custom_op("titan_ext::causal_conv1d_fwd", mutates_args=())
def causal_conv1d_fwd(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, residual: Tensor | None, initial_state: Tensor | None,
    output_final_state: bool, activation: str | None, cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """``(y, final state or empty)``."""
    fla = compat.fla_block_drivers()
    y, final_state = fla.causal_conv1d_fwd(
        x=x, weight=weight, bias=bias, residual=residual, initial_state=initial_state,
        output_final_state=output_final_state, activation=activation, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=op_parts.chunk_indices(fla, cu_seqlens, 64, cu_seqlens_cpu),
        layout_fallback=fla._has_non_standard_layout(x=x),
    )
    return y.contiguous(), final_state if final_state is not None else empty(x)


@causal_conv1d_fwd.register_fake
def _(x, weight, bias, residual, initial_state, output_final_state, activation, cu_seqlens, cu_seqlens_cpu):
    N = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final_state = x.new_empty(N, weight.shape[0], weight.shape[1]) if output_final_state else empty(x)
    return fresh(x), final_state


@torch.library.custom_op("titan_ext::causal_conv1d_bwd", mutates_args=())
def causal_conv1d_bwd(
    x: Tensor, dy: Tensor, dht: Tensor | None, weight: Tensor | None, bias: Tensor | None, residual: Tensor | None,
    initial_state: Tensor | None, activation: str | None, cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias, dinitial_state)``, each empty where absent (the residual's gradient is ``dy``)."""
    fla = compat.fla_block_drivers()
    dx, dw, db, _, dh0 = fla.causal_conv1d_bwd(
        x=x, dy=dy, dht=dht, weight=weight, bias=bias, residual=residual, initial_state=initial_state,
        activation=activation, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_indices=op_parts.chunk_indices(fla, cu_seqlens, 64, cu_seqlens_cpu),
        layout_fallback=fla._has_non_standard_layout(x=x),
    )
    return tuple(g.contiguous() if g is not None else empty(x) for g in (dx, dw, db, dh0))


@causal_conv1d_bwd.register_fake
def _(x, dy, dht, weight, bias, residual, initial_state, activation, cu_seqlens, cu_seqlens_cpu):
    return tuple(fresh(t) if t is not None else empty(x) for t in (x, weight, bias, initial_state))


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, initial_state, output_final_state, activation, cu_seqlens, cu_seqlens_cpu = inputs
    ctx.save_for_backward(x, weight, bias, residual, initial_state, cu_seqlens, cu_seqlens_cpu)
    ctx.activation, ctx.output_final_state = activation, output_final_state


def _backward(ctx, dy, dht):
    x, weight, bias, residual, initial_state, cu_seqlens, cu_seqlens_cpu = ctx.saved_tensors
    dx, dw, db, dh0 = torch.ops.titan_ext.causal_conv1d_bwd(
        x, dy, dht if ctx.output_final_state else None, weight, bias, residual, initial_state, ctx.activation,
        cu_seqlens, cu_seqlens_cpu)
    return dx, present(dw), present(db), dy if residual is not None else None, present(dh0), None, None, None, None


causal_conv1d_fwd.register_autograd(_backward, setup_context=_setup_context)


def _through_ops(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                 activation=None, backend="triton", cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                 cp_context=None, **kwargs):
    """fla's ``causal_conv1d`` (same arguments and returns) through ``titan_ext::causal_conv1d_fwd``/``bwd``;
    fla's context parallelism and other backends through fla's own."""
    if cp_context is not None or backend != "triton":
        return fla_causal_conv1d(
            x, weight=weight, bias=bias, residual=residual, initial_state=initial_state,
            output_final_state=output_final_state, activation=activation, backend=backend, cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices, cp_context=cp_context, **kwargs)
    y, final_state = torch.ops.titan_ext.causal_conv1d_fwd(
        x, weight, bias, residual, initial_state, bool(output_final_state), activation, cu_seqlens, cu_seqlens_cpu)
    return y, (final_state if output_final_state else None)


causal_conv1d = with_local_args(_through_ops)
"""What titan_ext's models call on the ``fla`` path instead of fla's ``causal_conv1d`` (its ``KERNELS``)."""

KERNELS = (
    Kernel(
        "fla.modules.causal_conv1d.ops:causal_conv1d", causal_conv1d,
        "fla's convolution as torch ops around fla's own drivers: compile keeps it, and ShortConvolution's "
        "forward, in the block's graph (fla's is a Triton autograd.Function, a graph break per call); " + TP_LOCAL,
        ("fla",),
    ),
)
"""What titan_ext's models call instead of fla's functions (``kernels.replacements``)."""

SIGNATURES = {
    "fla.modules.causal_conv1d.ops:causal_conv1d":
        "x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False, activation=None, backend='triton', cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, cp_context=None, **kwargs",
    "fla.modules.causal_conv1d.ops:causal_conv1d_fwd":
        "x, weight, bias, residual, initial_state=None, output_final_state=False, activation=None, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64, layout_fallback=False",
    "fla.modules.causal_conv1d.ops:causal_conv1d_bwd":
        "x, dy, dht, weight=None, bias=None, residual=None, initial_state=None, activation=None, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64, layout_fallback=False",
}
"""Parameters (``name=default``) of the functions replaced or called by keyword, as written against them
(``host.checks.check_fla_signatures``)."""
