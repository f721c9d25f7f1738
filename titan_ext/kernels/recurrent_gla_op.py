"""fla's ``fused_recurrent_gla`` as two torch ops, fla's drivers inside (the ``fla`` kernel path).

fla's GLA layer runs the fused recurrence instead of ``chunk_gla`` whenever a batch has at most 64
tokens (short training sequences, CP pieces, decoding): ``FusedRecurrentFunction``, a Triton launch
a compiled block could only call opaque (a graph break per GLA block). Here it is
``torch.ops.titan_ext.fused_recurrent_gla_fwd`` with ``titan_ext::fused_recurrent_gla_bwd`` as its
gradient: fla's ``fused_recurrent_fwd``/``bwd`` as the Function calls them (``g``, ``g_gamma`` None:
GLA's gates are ``gk``/``gv``), so its numbers are fla's.
"""

from __future__ import annotations

import torch
from fla.ops.gla.fused_recurrent import fused_recurrent_gla as fla_fused_recurrent_gla
from torch import Tensor

from titan_ext import compat
from titan_ext.kernels.gla_op import check_packed_states
from titan_ext.kernels.op_parts import empty, fresh, present
from titan_ext.kernels.table import Kernel

_FP32 = torch.float32


@torch.library.custom_op("titan_ext::fused_recurrent_gla_fwd", mutates_args=())
def fused_recurrent_gla_fwd(
    q: Tensor, k: Tensor, v: Tensor, gk: Tensor | None, gv: Tensor | None, scale: float, initial_state: Tensor | None,
    output_final_state: bool, reverse: bool, state_v_first: bool, cu_seqlens: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """``(o in fp32, final state or empty)``: fla's backward reads the fp32 ``o``."""
    q, k, v, gk, gv = (x.contiguous() if x is not None else None for x in (q, k, v, gk, gv))  # fla's input_guard
    o, ht = compat.fla_block_drivers().fused_recurrent_fwd(
        q=q, k=k, v=v, gk=gk, gv=gv, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        reverse=reverse, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
    )
    return o, ht if ht is not None else empty(q)


@fused_recurrent_gla_fwd.register_fake
def _(q, k, v, gk, gv, scale, initial_state, output_final_state, reverse, state_v_first, cu_seqlens):
    B, T, H, K = k.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    ht = q.new_empty((N, H, V, K) if state_v_first else (N, H, K, V), dtype=_FP32) if output_final_state else empty(q)
    return q.new_empty(v.shape, dtype=_FP32), ht


@torch.library.custom_op("titan_ext::fused_recurrent_gla_bwd", mutates_args=())
def fused_recurrent_gla_bwd(
    q: Tensor, k: Tensor, v: Tensor, gk: Tensor | None, gv: Tensor | None, o: Tensor, do: Tensor, dht: Tensor | None,
    scale: float, initial_state: Tensor | None, reverse: bool, state_v_first: bool, cu_seqlens: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dgk, dgv, dh0)``, each in its input's dtype, empty where the input is absent."""
    grads = compat.fla_block_drivers().fused_recurrent_bwd(
        q=q, k=k, v=v, gk=gk, gv=gv, o=o, do=do.contiguous(), dht=dht, scale=scale, initial_state=initial_state,
        reverse=reverse, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
    )
    dq, dk, dv, _, dgk, dgv, dh0 = grads
    return tuple(grad.to(x.dtype).contiguous() if x is not None else empty(q)
                 for grad, x in zip((dq, dk, dv, dgk, dgv, dh0), (q, k, v, gk, gv, initial_state)))


@fused_recurrent_gla_bwd.register_fake
def _(q, k, v, gk, gv, o, do, dht, scale, initial_state, reverse, state_v_first, cu_seqlens):
    return tuple(fresh(x) if x is not None else empty(q) for x in (q, k, v, gk, gv, initial_state))


def _setup_context(ctx, inputs, output):
    q, k, v, gk, gv, scale, initial_state, output_final_state, reverse, state_v_first, cu_seqlens = inputs
    ctx.save_for_backward(q, k, v, gk, gv, initial_state, output[0], cu_seqlens)
    ctx.scale, ctx.output_final_state, ctx.reverse, ctx.state_v_first = scale, output_final_state, reverse, state_v_first


def _backward(ctx, do, dht):
    q, k, v, gk, gv, initial_state, o, cu_seqlens = ctx.saved_tensors
    dq, dk, dv, dgk, dgv, dh0 = torch.ops.titan_ext.fused_recurrent_gla_bwd(
        q, k, v, gk, gv, o, do, dht if ctx.output_final_state else None, ctx.scale, initial_state, ctx.reverse,
        ctx.state_v_first, cu_seqlens)
    return dq, dk, dv, present(dgk), present(dgv), None, present(dh0), None, None, None, None


fused_recurrent_gla_fwd.register_autograd(_backward, setup_context=_setup_context)

SAVE_LIST = {torch.ops.titan_ext.fused_recurrent_gla_fwd.default}
"""What op-level SAC should keep of GLA's short-sequence core: its output (and final state)."""


def fused_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False,
                        reverse=False, state_v_first=False, cu_seqlens=None, **kwargs):
    """fla's ``fused_recurrent_gla`` (same arguments and returns) through ``titan_ext::fused_recurrent_gla_fwd``
    and ``bwd``; fla's deprecated keywords through fla's own."""
    if kwargs:
        return fla_fused_recurrent_gla(q, k, v, gk=gk, gv=gv, scale=scale, initial_state=initial_state,
                                       output_final_state=output_final_state, reverse=reverse,
                                       state_v_first=state_v_first, cu_seqlens=cu_seqlens, **kwargs)
    check_packed_states(q, initial_state, cu_seqlens)
    scale = k.shape[-1] ** -0.5 if scale is None else float(scale)
    o, ht = torch.ops.titan_ext.fused_recurrent_gla_fwd(q, k, v, gk, gv, scale, initial_state, output_final_state,
                                                        reverse, state_v_first, cu_seqlens)
    return o.to(q.dtype), (ht if output_final_state else None)


KERNELS = (
    Kernel(
        "fla.ops.gla.fused_recurrent:fused_recurrent_gla", fused_recurrent_gla,
        "GLA's short-sequence kernel as torch ops around fla's own drivers: compile keeps it in the graph (fla's "
        "is a Triton autograd.Function, a graph break per call)",
        ("fla",),
    ),
)
"""What titan_ext's models call instead of fla's functions (``kernels.replacements``)."""

SIGNATURES = {
    "fla.ops.gla.fused_recurrent:fused_recurrent_gla":
        "q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False, reverse=False, state_v_first=False, cu_seqlens=None, **kwargs",
    "fla.ops.common.fused_recurrent:fused_recurrent_fwd":
        "q, k, v, g=None, g_gamma=None, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False, reverse=False, state_v_first=False, cu_seqlens=None",
    "fla.ops.common.fused_recurrent:fused_recurrent_bwd":
        "q, k, v, g=None, g_gamma=None, gk=None, gv=None, o=None, do=None, dht=None, scale=None, initial_state=None, reverse=False, state_v_first=False, cu_seqlens=None",
}
"""Parameters (``name=default``) of the functions replaced or called by keyword, as written against them
(``host.checks.check_fla_signatures``)."""
