"""fla's ``chunk_gated_delta_rule`` as two torch ops, fla's drivers inside (the ``fla`` kernel path, CUDA).

fla's ``chunk_gated_delta_rule`` is ``ChunkGatedDeltaRuleFunction``, Triton launches behind
``torch.compiler.disable``: a compiled Gated DeltaNet block broke its graph at the mixer, and
op-level selective AC, seeing no dispatcher op in it, reran the whole forward in backward's
recompute. Here the core is ``torch.ops.titan_ext.chunk_gated_delta_rule_fwd``: fla's pieces in the
order the Function runs them (the in-kernel L2 norm of q and k, ``sigmoid(beta)``,
``chunk_gated_delta_rule_fwd``), returning ``o``, the final state and what fla's backward reads (the
cumulated gate, the chunk matrix ``A``, the normalised q/k with their ``rstd``, the activated beta);
its autograd formula calls ``titan_ext::chunk_gated_delta_rule_bwd`` (fla's ``chunk_gated_delta_rule_bwd``,
then the norm's and the sigmoid's backward). SAC can ``MUST_SAVE`` the forward (``SAVE_LIST``).
Both run inside fla's ``input_guard``, as the Function's forward and backward do: the backward reads
the raw ``v``, ``g`` and ``beta`` the forward saved, the caller's tensors, strided views where fla's
fused q/k/v convolution leaves them, and fla's kernels read memory densely. Without it the gradients of
q, k, the gate and beta were wrong wherever the convolution is fused (one process; TP runs the three
apart), seen as CP=2 and TP=2 disagreeing with one process (``tests/interpret_checks.py``: ``block_ops``'s
strided case).

What the ops do not take goes to fla's function as shipped: fla's own context parallelism
(``cp_context``) and precomputed ``chunk_indices``. Under TP the per-head ``A_log``/``dt_bias`` arrive
as DTensor shards: their local shards (``tp_local.with_local_args``).
"""

from __future__ import annotations

import torch
from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule as fla_chunk_gated_delta_rule
from torch import Tensor

from titan_ext import compat
from titan_ext.kernels import op_parts
from titan_ext.kernels.gla_op import check_packed_states
from titan_ext.kernels.op_parts import empty, present
from titan_ext.kernels.table import Kernel
from titan_ext.kernels.tp_local import with_local_args

_FP32 = torch.float32
CHUNK_SIZES = (16, 32, 64)
"""fla's gated-delta-rule chunk sizes (``chunk_size`` keyword; 64 unless given)."""


@torch.library.custom_op("titan_ext::chunk_gated_delta_rule_fwd", mutates_args=())
def chunk_gated_delta_rule_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor | None, dt_bias: Tensor | None,
    scale: float, initial_state: Tensor | None, output_final_state: bool, use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, state_v_first: bool,
    cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None, chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(o, final state, cumulated gate, A, normalised q, q rstd, normalised k, k rstd, sigmoid(beta))``, each
    empty where fla keeps none (no final state asked; no in-kernel norm or sigmoid)."""
    fla = compat.fla_block_drivers()

    @fla.input_guard  # contiguous inputs, the inputs' device current (as around ChunkGatedDeltaRuleFunction.forward)
    def run(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens):
        qn = kn = q_rstd = k_rstd = beta_act = None
        if use_qk_l2norm_in_kernel:
            (qn, q_rstd), (kn, k_rstd) = fla.l2norm_fwd(q), fla.l2norm_fwd(k)
        if use_beta_sigmoid_in_kernel:
            beta_act = fla.fused_beta_sigmoid_fwd(beta, scale=2.0 if allow_neg_eigval else 1.0)
        g_cumsum, o, A, ht, _, _ = fla.chunk_gated_delta_rule_fwd(
            q=q if qn is None else qn, k=k if kn is None else kn, v=v, g=g,
            beta=beta if beta_act is None else beta_act, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
            chunk_indices=op_parts.chunk_indices(fla, cu_seqlens, chunk_size, cu_seqlens_cpu),
            use_gate_in_kernel=use_gate_in_kernel, A_log=A_log if use_gate_in_kernel else None,
            dt_bias=dt_bias if use_gate_in_kernel else None, chunk_size=chunk_size,
        )
        return o.to(q.dtype), ht, g_cumsum, A, qn, q_rstd, kn, k_rstd, beta_act

    outputs = run(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens)
    return tuple(x if x is not None else empty(q) for x in outputs)


@chunk_gated_delta_rule_fwd.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
      use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, cu_seqlens_cpu,
      chunk_size):
    B, T, HV, V = v.shape
    K = q.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    new = lambda *shape, dtype: q.new_empty(shape, dtype=dtype)  # noqa: E731
    ht = new(*((N, HV, V, K) if state_v_first else (N, HV, K, V)), dtype=_FP32) if output_final_state else empty(q)
    if use_qk_l2norm_in_kernel:
        normed = [new(*q.shape, dtype=q.dtype), new(*q.shape[:-1], dtype=_FP32), new(*k.shape, dtype=k.dtype),
                  new(*k.shape[:-1], dtype=_FP32)]
    else:
        normed = [empty(q)] * 4
    beta_act = new(*beta.shape, dtype=_FP32) if use_beta_sigmoid_in_kernel else empty(q)
    return (new(B, T, HV, V, dtype=q.dtype), ht, new(B, T, HV, dtype=_FP32), new(B, T, HV, chunk_size, dtype=k.dtype),
            *normed, beta_act)


@torch.library.custom_op("titan_ext::chunk_gated_delta_rule_bwd", mutates_args=())
def chunk_gated_delta_rule_bwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor | None, dt_bias: Tensor | None,
    initial_state: Tensor | None, g_cumsum: Tensor, A: Tensor, q_rstd: Tensor, k_rstd: Tensor, beta_act: Tensor,
    do: Tensor, dht: Tensor | None, scale: float, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, state_v_first: bool, cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None, chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias)``, contiguous, each in its input's dtype, empty where the
    input is absent or unused; ``q``/``k``: the ones fla's kernels read (normalised in the kernel: the forward's
    outputs), ``g`` the raw input, ``beta`` the raw input and ``beta_act`` its sigmoid (empty without one)."""
    fla = compat.fla_block_drivers()

    # contiguous inputs, as around ChunkGatedDeltaRuleFunction.backward: the saved raw v, g and beta are the
    # caller's tensors, which a fused q/k/v convolution leaves as strided views (fla's kernels read them densely)
    @fla.input_guard
    def run(q, k, v, g, beta, A_log, dt_bias, initial_state, g_cumsum, A, q_rstd, k_rstd, beta_act, do, dht,
            cu_seqlens):
        dq, dk, dv, db, dg, dh0, dA, dbias = fla.chunk_gated_delta_rule_bwd(
            q=q, k=k, v=v, g=g_cumsum, beta=beta_act if use_beta_sigmoid_in_kernel else beta, A=A, scale=scale,
            initial_state=initial_state, do=do, dht=dht, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
            chunk_indices=op_parts.chunk_indices(fla, cu_seqlens, chunk_size, cu_seqlens_cpu),
            use_gate_in_kernel=use_gate_in_kernel, g_input=g if use_gate_in_kernel else None,
            A_log=A_log if use_gate_in_kernel else None, dt_bias=dt_bias if use_gate_in_kernel else None,
            chunk_size=chunk_size,
        )
        if use_qk_l2norm_in_kernel:
            dq, dk = fla.l2norm_bwd(q, q_rstd, dq), fla.l2norm_bwd(k, k_rstd, dk)
        if use_beta_sigmoid_in_kernel:
            db = fla.fused_beta_sigmoid_bwd(x=beta, dy=db, scale=2.0 if allow_neg_eigval else 1.0)
        return dq, dk, dv, dg, db, dh0, dA, dbias

    grads = run(q, k, v, g, beta, A_log, dt_bias, initial_state, g_cumsum, A, q_rstd, k_rstd, beta_act, do, dht,
                cu_seqlens)
    inputs = (q, k, v, g, beta, initial_state, A_log if use_gate_in_kernel else None,
              dt_bias if use_gate_in_kernel else None)
    return tuple(grad.to(x.dtype).contiguous() if grad is not None and x is not None else empty(q)
                 for grad, x in zip(grads, inputs))


@chunk_gated_delta_rule_bwd.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, g_cumsum, A, q_rstd, k_rstd, beta_act, do, dht, scale,
      use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
      cu_seqlens, cu_seqlens_cpu, chunk_size):
    like = lambda x: op_parts.fresh(x) if x is not None else empty(q)  # noqa: E731
    gate = use_gate_in_kernel
    return (*(like(x) for x in (q, k, v, g, beta, initial_state)), like(A_log if gate else None),
            like(dt_bias if gate else None))


def _setup_context(ctx, inputs, output):
    (q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
     use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, cu_seqlens_cpu,
     chunk_size) = inputs
    _, _, g_cumsum, A, qn, q_rstd, kn, k_rstd, beta_act = output
    if use_qk_l2norm_in_kernel:  # fla's backward reads the normalised q and k (kept as fla keeps them)
        q, k = qn, kn
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, g_cumsum, A, q_rstd, k_rstd, beta_act,
                          cu_seqlens, cu_seqlens_cpu)
    ctx.scale, ctx.output_final_state, ctx.chunk_size = scale, output_final_state, chunk_size
    ctx.flags = (use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                 state_v_first)
    ctx.mark_non_differentiable(*output[2:])


def _backward(ctx, do, dht, *_):
    (q, k, v, g, beta, A_log, dt_bias, initial_state, g_cumsum, A, q_rstd, k_rstd, beta_act, cu_seqlens,
     cu_seqlens_cpu) = ctx.saved_tensors
    dq, dk, dv, dg, dbeta, dh0, dA, dbias = torch.ops.titan_ext.chunk_gated_delta_rule_bwd(
        q, k, v, g, beta, A_log, dt_bias, initial_state, g_cumsum, A, q_rstd, k_rstd, beta_act, do,
        dht if ctx.output_final_state else None, ctx.scale, *ctx.flags, cu_seqlens, cu_seqlens_cpu, ctx.chunk_size,
    )
    return (dq, dk, dv, dg, dbeta, present(dA), present(dbias), None, present(dh0), *[None] * 9)


chunk_gated_delta_rule_fwd.register_autograd(_backward, setup_context=_setup_context)

SAVE_LIST = {torch.ops.titan_ext.chunk_gated_delta_rule_fwd.default}
"""What op-level SAC should keep of the Gated DeltaNet core once models call it: its forward's outputs."""


def _check(q, k, v, g, beta, initial_state, cu_seqlens, use_gate_in_kernel, A_log, chunk_size) -> None:
    """fla's argument checks, so the op refuses what ``chunk_gated_delta_rule`` refuses (as ValueError)."""
    check_packed_states(q, initial_state, cu_seqlens)
    if use_gate_in_kernel and A_log is None:
        raise ValueError("use_gate_in_kernel=True needs A_log.")
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES} for the gated delta rule, not {chunk_size}.")
    H, HV = q.shape[2], v.shape[2]
    if k.shape != q.shape or HV % H:
        raise ValueError(f"q and k must be [B, T, H, K] and v [B, T, HV, V] with HV a multiple of H; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}.")


def _through_ops(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
    use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False, cu_seqlens=None,
    cu_seqlens_cpu=None, chunk_indices=None, cp_context=None, **kwargs,
):
    """fla's ``chunk_gated_delta_rule`` (same arguments and returns) through ``titan_ext::chunk_gated_delta_rule_fwd``
    and ``bwd``."""
    unknown = kwargs.keys() - {"use_gate_in_kernel", "A_log", "dt_bias", "chunk_size"}
    if cp_context is not None or chunk_indices is not None or unknown:
        return fla_chunk_gated_delta_rule(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices, cp_context=cp_context, **kwargs,
        )
    use_gate_in_kernel = kwargs.get("use_gate_in_kernel", False)
    A_log, dt_bias = (kwargs.get("A_log"), kwargs.get("dt_bias")) if use_gate_in_kernel else (None, None)
    chunk_size = kwargs.get("chunk_size", 64)
    _check(q, k, v, g, beta, initial_state, cu_seqlens, use_gate_in_kernel, A_log, chunk_size)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o, ht, *_ = torch.ops.titan_ext.chunk_gated_delta_rule_fwd(
        q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
        use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, cu_seqlens_cpu,
        chunk_size,
    )
    return o, (ht if output_final_state else None)


chunk_gated_delta_rule = with_local_args(_through_ops)
"""What titan_ext's Gated DeltaNet models call on the ``fla`` path instead of fla's ``chunk_gated_delta_rule``."""

KERNELS = (
    Kernel(
        "fla.ops.gated_delta_rule.chunk:chunk_gated_delta_rule", chunk_gated_delta_rule,
        "Gated DeltaNet's training kernel as torch ops around fla's own drivers: op-level SAC can save it and "
        "compile keeps it in the graph (fla's is a Triton autograd.Function behind torch.compiler.disable); under "
        "TP its A_log/dt_bias arrive as DTensor shards, which fla's Triton code cannot read: their local shards",
        ("fla",),
    ),
)
"""What titan_ext's models call instead of fla's functions (``kernels.replacements``)."""

SIGNATURES = {
    "fla.ops.gated_delta_rule.chunk:chunk_gated_delta_rule":
        "q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, cp_context=None, **kwargs",
    "fla.ops.gated_delta_rule.chunk:chunk_gated_delta_rule_fwd":
        "q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first=False, cu_seqlens=None, cp_context=None, chunk_indices=None, use_gate_in_kernel=False, A_log=None, dt_bias=None, chunk_size=64",
    "fla.ops.gated_delta_rule.chunk:chunk_gated_delta_rule_bwd":
        "q, k, v, g, beta, A, scale, initial_state, do, dht, state_v_first=False, cu_seqlens=None, cp_context=None, chunk_indices=None, use_gate_in_kernel=False, g_input=None, A_log=None, dt_bias=None, chunk_size=64",
}
"""Parameters (``name=default``) of the functions replaced or called by keyword, as written against them
(``host.checks.check_fla_signatures``)."""
