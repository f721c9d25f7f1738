"""fla's ``chunk_gla`` as two torch ops, so op-level SAC can save it and compile keeps it in the graph.

fla's ``chunk_gla`` is a ``torch.autograd.Function`` that launches Triton
kernels behind ``torch.compiler.disable``. For training that costs twice:

* op-level selective AC sees only dispatcher ops. Triton launches are not
  ones, so whatever the save list says, backward's recompute reruns the whole
  GLA forward (gate cumsum, state pass, intra-chunk ``A``, output);
* every compiled GLA block breaks its graph at the token mixer.

Here the GLA core is ``torch.ops.titan_ext.chunk_gla_fwd`` (returns ``o``, the
final state, and the intra-chunk matrix ``A`` that backward reuses) with an
autograd formula calling ``torch.ops.titan_ext.chunk_gla_bwd``. SAC can
``MUST_SAVE`` the forward (``SAVE_LIST``); dynamo treats both as opaque ops
with fake (shape-only) implementations.

Per kernel path (``fla_kernels``), inside the ops: fla's own forward and
backward drivers (``fla.ops.gla.chunk.chunk_gla_fwd``/``chunk_gla_bwd``, the
ones ``ChunkGLAFunction`` runs; the gate's chunk cumsum is recomputed in
backward, as fla does for non-fp32 gates), on CUDA or under Triton's
interpreter; or the portable torch GLA (``titan_ext.kernels.gla``), whose
backward differentiates it with autograd: it recomputes the forward, fine for
a path that exists for correctness.

DTensor inputs (a TP plan that hands the mixer DTensors; the bundled plans
give it local shards) skip the ops: fla's kernel or the portable GLA.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from titan_ext import compat
from titan_ext.kernels import gla as portable
from titan_ext.kernels.gla import fla_chunk_size
from titan_ext.kernels.op_parts import fresh
from titan_ext.kernels.table import Kernel

_FP32 = torch.float32


def _empty(like: Tensor) -> Tensor:
    """The stand-in for an absent tensor output (custom ops cannot return None)."""
    return like.new_empty(0, dtype=_FP32)


def _chunk_indices(fla, cu_seqlens, chunk_size, cu_seqlens_cpu):
    if cu_seqlens is None:
        return None
    return fla.prepare_chunk_indices(cu_seqlens, chunk_size, cu_seqlens_cpu=cu_seqlens_cpu)


def _fla_forward(q, k, v, g, scale, initial_state, output_final_state, state_v_first, cu_seqlens, cu_seqlens_cpu):
    fla = compat.fla_gla_drivers()
    chunk_size = fla_chunk_size(q.shape[1])

    # input_guard: contiguous inputs, current device = theirs (what ChunkGLAFunction does around the same call)
    @fla.input_guard
    def run(q, k, v, g, initial_state, cu_seqlens):
        return fla.chunk_gla_fwd(
            q=q, k=k, v=v, g=g, g_cumsum=None, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
            chunk_size=chunk_size, chunk_indices=_chunk_indices(fla, cu_seqlens, chunk_size, cu_seqlens_cpu),
        )

    _, A, _, ht, o = run(q, k, v, g, initial_state, cu_seqlens)
    return o, ht, A


def _fla_backward(q, k, v, g, A, initial_state, do, dht, scale, state_v_first, cu_seqlens, cu_seqlens_cpu):
    fla = compat.fla_gla_drivers()
    chunk_size = fla_chunk_size(q.shape[1])

    @fla.input_guard
    def run(q, k, v, g, A, initial_state, do, dht, cu_seqlens):
        return fla.chunk_gla_bwd(
            q=q, k=k, v=v, g=g, g_cumsum=None, scale=scale, initial_state=initial_state, h=None, A=A, do=do,
            dht=dht, state_v_first=state_v_first, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
            chunk_indices=_chunk_indices(fla, cu_seqlens, chunk_size, cu_seqlens_cpu),
        )

    return run(q, k, v, g, A, initial_state, do, dht, cu_seqlens)


def _portable_forward(q, k, v, g, scale, initial_state, output_final_state, state_v_first, cu_seqlens, cu_seqlens_cpu):
    o, ht = portable.chunk_gla(
        q, k, v, g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
    )
    return o.to(v.dtype).contiguous(), (ht.contiguous() if ht is not None else None), None


def _portable_backward(q, k, v, g, A, initial_state, do, dht, scale, state_v_first, cu_seqlens, cu_seqlens_cpu):
    with compat.autograd_enabled_inside_kernel(), torch.enable_grad():
        primals = [x.detach().requires_grad_() for x in (q, k, v, g)]
        h0 = initial_state.detach().requires_grad_() if initial_state is not None else None
        o, ht = portable.chunk_gla(
            *primals, scale=scale, initial_state=h0, output_final_state=dht is not None,
            state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        )
        outputs, cotangents = [o.to(v.dtype)], [do]
        if dht is not None:
            outputs.append(ht)
            cotangents.append(dht)
        grads = torch.autograd.grad(outputs, primals + ([h0] if h0 is not None else []), cotangents)
    return (*grads, None) if h0 is None else grads


@torch.library.custom_op("titan_ext::chunk_gla_fwd", mutates_args=())
def chunk_gla_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float, initial_state: Tensor | None,
    output_final_state: bool, state_v_first: bool, cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None,
    fla_kernels: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(o, final state or empty, A or empty)``; ``A`` is fla's fp32 intra-chunk matrix (fla's kernels only)."""
    run = _fla_forward if fla_kernels else _portable_forward
    o, ht, A = run(q, k, v, g, scale, initial_state, output_final_state, state_v_first, cu_seqlens, cu_seqlens_cpu)
    return o, (ht if ht is not None else _empty(q)), (A if A is not None else _empty(q))


@chunk_gla_fwd.register_fake
def _(q, k, v, g, scale, initial_state, output_final_state, state_v_first, cu_seqlens, cu_seqlens_cpu, fla_kernels):
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    o = fresh(v)
    state_dtype = _FP32 if fla_kernels else torch.promote_types(q.dtype, _FP32)  # the portable path keeps fp64
    state_shape = (N, H, V, K) if state_v_first else (N, H, K, V)
    ht = q.new_empty(state_shape, dtype=state_dtype) if output_final_state else _empty(q)
    A = q.new_empty(B, T, H, fla_chunk_size(T), dtype=_FP32) if fla_kernels else _empty(q)
    return o, ht, A


@torch.library.custom_op("titan_ext::chunk_gla_bwd", mutates_args=())
def chunk_gla_bwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, A: Tensor, initial_state: Tensor | None, do: Tensor,
    dht: Tensor | None, scale: float, state_v_first: bool, cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None,
    fla_kernels: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dg, dh0 or empty)``, contiguous, each in its input's dtype (as the fake says)."""
    run = _fla_backward if fla_kernels else _portable_backward
    dq, dk, dv, dg, dh0 = run(q, k, v, g, A, initial_state, do, dht, scale, state_v_first, cu_seqlens, cu_seqlens_cpu)
    grads = [grad.to(x.dtype).contiguous() for grad, x in zip((dq, dk, dv, dg), (q, k, v, g))]
    return (*grads, dh0.to(_FP32).contiguous() if dh0 is not None else _empty(q))


@chunk_gla_bwd.register_fake
def _(q, k, v, g, A, initial_state, do, dht, scale, state_v_first, cu_seqlens, cu_seqlens_cpu, fla_kernels):
    dh0 = torch.empty_like(initial_state, dtype=_FP32) if initial_state is not None else _empty(q)
    return (*(fresh(x) for x in (q, k, v, g)), dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, g, scale, initial_state, output_final_state, state_v_first, cu_seqlens, cu_seqlens_cpu, fla_kernels = inputs
    _, _, A = output
    ctx.save_for_backward(q, k, v, g, A, initial_state, cu_seqlens, cu_seqlens_cpu)
    ctx.scale, ctx.output_final_state, ctx.state_v_first = scale, output_final_state, state_v_first
    ctx.fla_kernels = fla_kernels
    ctx.mark_non_differentiable(A)


def _backward(ctx, do, dht, _dA):
    q, k, v, g, A, initial_state, cu_seqlens, cu_seqlens_cpu = ctx.saved_tensors
    dht = dht if ctx.output_final_state else None
    dq, dk, dv, dg, dh0 = torch.ops.titan_ext.chunk_gla_bwd(
        q, k, v, g, A, initial_state, do, dht, ctx.scale, ctx.state_v_first, cu_seqlens, cu_seqlens_cpu, ctx.fla_kernels
    )
    return dq, dk, dv, dg, None, dh0 if initial_state is not None else None, None, None, None, None, None


chunk_gla_fwd.register_autograd(_backward, setup_context=_setup_context)

SAVE_LIST = {torch.ops.titan_ext.chunk_gla_fwd.default}
"""What op-level SAC should keep of the GLA core: its forward's outputs (``o``, ``A``)."""


def check_packed_states(q, initial_state, cu_seqlens) -> None:
    """fla's checks of packed rows and initial states, shared by its chunked kernels (GLA's, KDA's)."""
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"With `cu_seqlens` the batch size must be 1, not {q.shape[0]}; flatten the inputs.")
        if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
            raise ValueError(
                f"Expected one initial state per sequence ({len(cu_seqlens) - 1}), got {initial_state.shape[0]}."
            )
    if initial_state is not None and initial_state.dtype != _FP32:
        raise ValueError(f"initial_state must be float32, not {initial_state.dtype}.")


def _check_inputs(q, k, v, g, initial_state, cu_seqlens) -> None:
    """fla's own argument checks, so the op fails as ``chunk_gla`` would."""
    check_packed_states(q, initial_state, cu_seqlens)
    if not q.shape == k.shape == g.shape:
        raise ValueError(f"q, k and g must have one shape; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(g.shape)}.")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] with q's B, T, H; got {tuple(v.shape)} for q {tuple(q.shape)}.")


def chunk_gla(
    q, k, v, g, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
    cu_seqlens=None, cu_seqlens_cpu=None,
):
    """fla's ``chunk_gla`` (same arguments and returns) through ``titan_ext::chunk_gla_fwd``/``bwd``, fla's
    drivers inside (the ``fla`` kernel path)."""
    return _through_ops(q, k, v, g, scale, initial_state, output_final_state, state_v_first, cu_seqlens,
                        cu_seqlens_cpu, fla_kernels=True)


def portable_chunk_gla(
    q, k, v, g, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
    cu_seqlens=None, cu_seqlens_cpu=None,
):
    """The same, titan_ext's torch GLA inside (the ``portable`` kernel path)."""
    return _through_ops(q, k, v, g, scale, initial_state, output_final_state, state_v_first, cu_seqlens,
                        cu_seqlens_cpu, fla_kernels=False)


def _through_ops(q, k, v, g, scale, initial_state, output_final_state, state_v_first, cu_seqlens, cu_seqlens_cpu,
                 fla_kernels):
    args = (q, k, v, g, scale, initial_state, output_final_state, state_v_first, cu_seqlens, cu_seqlens_cpu)
    if any(isinstance(x, DTensor) for x in (q, k, v, g, initial_state)):  # both take DTensors' local math
        return compat.fla_gla_drivers().chunk_gla(*args) if fla_kernels else portable.chunk_gla(*args)
    _check_inputs(q, k, v, g, initial_state, cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o, ht, _ = torch.ops.titan_ext.chunk_gla_fwd(
        q, k, v, g, scale, initial_state, output_final_state, state_v_first, cu_seqlens, cu_seqlens_cpu, fla_kernels
    )
    return o, (ht if output_final_state else None)


KERNELS = (
    Kernel(
        "fla.ops.gla.chunk:chunk_gla", chunk_gla,
        "GLA's training kernel as torch ops: op-level SAC can save it and compile keeps it in the graph (fla's "
        "is a Triton autograd.Function behind torch.compiler.disable); fla's drivers run inside",
        ("fla",),
    ),
    Kernel(
        "fla.ops.gla.chunk:chunk_gla", portable_chunk_gla,
        "the same torch ops with titan_ext's torch GLA inside (on any device)",
    ),
)
"""What titan_ext's models call instead of fla's functions (``kernels.replacements``)."""

SIGNATURES = {
    "fla.ops.gla.chunk:chunk_gla":
        "q, k, v, g, scale=None, initial_state=None, output_final_state=False, state_v_first=False, "
        "cu_seqlens=None, cu_seqlens_cpu=None",
    "fla.ops.gla.chunk:chunk_gla_fwd":
        "q, k, v, g, g_cumsum, scale, initial_state, output_final_state, state_v_first=False, cu_seqlens=None, "
        "chunk_size=64, chunk_indices=None",
    "fla.ops.gla.chunk:chunk_gla_bwd":
        "q, k, v, g, g_cumsum, scale, initial_state, h, A, do, dht, state_v_first=False, cu_seqlens=None, "
        "chunk_size=64, chunk_indices=None",
}
"""Parameters (``name=default``) of the functions replaced or called by keyword, as written against them
(``host.checks.check_fla_signatures``)."""
