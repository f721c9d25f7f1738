"""fla's ``chunk_kda`` as two torch ops, so op-level SAC can save it (the ``fla`` kernel path, CUDA).

fla's ``chunk_kda`` is a ``torch.autograd.Function`` of Triton launches behind
``torch.compiler.disable``: op-level selective AC sees no dispatcher op in it,
so whatever the save list says, backward's recompute reruns the whole KDA
forward (gate and chunk cumsum, intra-chunk solve, state pass, output), and a
compiled block breaks its graph at the mixer.

Here the KDA core is ``torch.ops.titan_ext.chunk_kda_fwd``: fla's own pieces,
in the order ``ChunkKDAFunction`` runs them (the in-kernel L2 norm of q and
k, ``sigmoid(beta)``, ``chunk_kda_fwd``), returning ``o``, the final state and
what fla's backward reads (the chunk matrices ``Aqk``/``Akk``, the cumulated
gate where it is not recomputed, the normalised q/k with their ``rstd``, the
activated beta). Its autograd formula calls ``torch.ops.titan_ext.chunk_kda_bwd``
(fla's ``chunk_kda_bwd``, then the norm's and the sigmoid's backward). SAC can
``MUST_SAVE`` the forward (``SAVE_LIST``); dynamo sees two opaque ops with fake
(shape-only) implementations. Memory per KDA block under op SAC: what fla's
Function saves for its backward, plus the output ``o`` (and final state).

What the ops do not take goes to fla's ``chunk_kda`` as shipped: fla's own
context parallelism (``cp_context``), ``disable_recompute``, CUDA-graph
(``use_graph``) and inference-only ``return_intermediate_states``. Under TP
the per-head ``A_log``/``dt_bias`` arrive as DTensor shards: their local
shards (``tp_local.with_local_args``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from titan_ext import compat
from titan_ext.kernels.gla_op import check_packed_states
from titan_ext.kernels.op_parts import chunk_indices, empty, fresh, present
from titan_ext.kernels.table import TP_LOCAL, Kernel
from titan_ext.kernels.tp_local import with_local_args

_FP32 = torch.float32
CHUNK_SIZES = (32, 64)
"""fla's KDA chunk sizes (``chunk_size`` keyword; 64 unless given)."""


@torch.library.custom_op("titan_ext::chunk_kda_fwd", mutates_args=())
def chunk_kda_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor | None, dt_bias: Tensor | None,
    scale: float, initial_state: Tensor | None, output_final_state: bool, use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, safe_gate: bool,
    lower_bound: float | None, state_v_first: bool, cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None,
    chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(o, final state, cumulated gate, Aqk, Akk, normalised q, q rstd, normalised k, k rstd, sigmoid(beta))``,
    each empty where fla keeps none (no final state asked; the gate recomputed in backward when it is computed
    in the kernel; no in-kernel norm or sigmoid)."""
    fla = compat.fla_kda_drivers()

    @fla.input_guard  # contiguous inputs, the inputs' device current (as around ChunkKDAFunction.forward)
    def run(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens):
        qn = kn = q_rstd = k_rstd = beta_act = None
        if use_qk_l2norm_in_kernel:
            (qn, q_rstd), (kn, k_rstd) = fla.l2norm_fwd(q), fla.l2norm_fwd(k)
        if use_beta_sigmoid_in_kernel:
            beta_act = fla.fused_beta_sigmoid_fwd(beta, scale=2.0 if allow_neg_eigval else 1.0)
        o, ht, g_cumsum, Aqk, Akk, *_ = fla.chunk_kda_fwd(
            q=q if qn is None else qn, k=k if kn is None else kn, v=v, g=g, beta=beta if beta_act is None else beta_act,
            scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
            chunk_indices=chunk_indices(fla, cu_seqlens, chunk_size, cu_seqlens_cpu), chunk_size=chunk_size,
            safe_gate=safe_gate, lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel,
            A_log=A_log if use_gate_in_kernel else None, dt_bias=dt_bias if use_gate_in_kernel else None,
        )
        return o.type_as(q), ht, g_cumsum, Aqk, Akk, qn, q_rstd, kn, k_rstd, beta_act

    outputs = run(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens)
    return tuple(x if x is not None else empty(q) for x in outputs)


@chunk_kda_fwd.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
      use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, state_v_first,
      cu_seqlens, cu_seqlens_cpu, chunk_size):
    B, T, HV, V = v.shape
    K = q.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    new = lambda *shape, dtype: q.new_empty(shape, dtype=dtype)  # noqa: E731
    o = new(B, T, HV, V, dtype=q.dtype)
    ht = new(*((N, HV, V, K) if state_v_first else (N, HV, K, V)), dtype=_FP32) if output_final_state else empty(q)
    g_cumsum = empty(q) if use_gate_in_kernel else new(B, T, HV, K, dtype=_FP32)
    Aqk, Akk = new(B, T, HV, chunk_size, dtype=k.dtype), new(B, T, HV, chunk_size, dtype=k.dtype)
    if use_qk_l2norm_in_kernel:
        normed = [fresh(q), new(*q.shape[:-1], dtype=_FP32),
                  fresh(k), new(*k.shape[:-1], dtype=_FP32)]
    else:
        normed = [empty(q)] * 4
    beta_act = new(*beta.shape, dtype=_FP32) if use_beta_sigmoid_in_kernel else empty(q)
    return o, ht, g_cumsum, Aqk, Akk, *normed, beta_act


@torch.library.custom_op("titan_ext::chunk_kda_bwd", mutates_args=())
def chunk_kda_bwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor | None, dt_bias: Tensor | None,
    initial_state: Tensor | None, g_cumsum: Tensor, Aqk: Tensor, Akk: Tensor, q_rstd: Tensor, k_rstd: Tensor,
    beta_act: Tensor, do: Tensor, dht: Tensor | None, scale: float, use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, safe_gate: bool,
    lower_bound: float | None, state_v_first: bool, cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None,
    chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias)``, contiguous, each in its input's dtype, empty where
    the input is absent (or, for ``A_log``/``dt_bias``, unused: the gate computed outside the kernel).

    ``q``/``k`` are the ones fla's kernels read (L2-normalised in the kernel: the forward's outputs), ``beta``
    the raw input and ``beta_act`` its sigmoid (empty without one)."""
    fla = compat.fla_kda_drivers()
    if not use_gate_in_kernel:
        A_log = dt_bias = None

    @fla.input_guard
    def run(q, k, v, g, beta, A_log, dt_bias, initial_state, g_cumsum, Aqk, Akk, beta_act, do, dht, cu_seqlens):
        dq, dk, dv, db, dg, dh0, dA, dbias = fla.chunk_kda_bwd(
            q=q, k=k, v=v, beta=beta_act if use_beta_sigmoid_in_kernel else beta, Aqk=Aqk, Akk=Akk, scale=scale,
            initial_state=initial_state, do=do, dht=dht, g=present(g_cumsum),
            g_org=g if use_gate_in_kernel else None, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices(fla, cu_seqlens, chunk_size, cu_seqlens_cpu), chunk_size=chunk_size,
            safe_gate=safe_gate, lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
            dt_bias=dt_bias,
        )
        if use_qk_l2norm_in_kernel:
            dq, dk = fla.l2norm_bwd(q, q_rstd, dq), fla.l2norm_bwd(k, k_rstd, dk)
        if use_beta_sigmoid_in_kernel:
            db = fla.fused_beta_sigmoid_bwd(x=beta, dy=db, scale=2.0 if allow_neg_eigval else 1.0)
        return dq, dk, dv, dg, db, dh0, dA, dbias

    grads = run(q, k, v, g, beta, A_log, dt_bias, initial_state, g_cumsum, Aqk, Akk, beta_act, do, dht, cu_seqlens)
    inputs = (q, k, v, g, beta, initial_state, A_log, dt_bias)
    return tuple(
        grad.to(x.dtype).contiguous() if grad is not None and x is not None else empty(q)
        for grad, x in zip(grads, inputs)
    )


@chunk_kda_bwd.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, g_cumsum, Aqk, Akk, q_rstd, k_rstd, beta_act, do, dht, scale,
      use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate,
      lower_bound, state_v_first, cu_seqlens, cu_seqlens_cpu, chunk_size):
    like = lambda x: fresh(x) if x is not None else empty(q)  # noqa: E731
    gate = use_gate_in_kernel
    return (*(like(x) for x in (q, k, v, g, beta, initial_state)), like(A_log if gate else None),
            like(dt_bias if gate else None))


def _setup_context(ctx, inputs, output):
    (q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
     use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, state_v_first,
     cu_seqlens, cu_seqlens_cpu, chunk_size) = inputs
    _, _, g_cumsum, Aqk, Akk, qn, q_rstd, kn, k_rstd, beta_act = output
    if use_qk_l2norm_in_kernel:  # fla's backward reads the normalised q and k, not the inputs (kept as fla keeps them)
        q, k = qn, kn
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, g_cumsum, Aqk, Akk, q_rstd, k_rstd,
                          beta_act, cu_seqlens, cu_seqlens_cpu)
    ctx.scale, ctx.output_final_state = scale, output_final_state
    ctx.flags = (use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate,
                 lower_bound, state_v_first)
    ctx.chunk_size = chunk_size
    ctx.mark_non_differentiable(*output[2:])


def _backward(ctx, do, dht, *_):
    (q, k, v, g, beta, A_log, dt_bias, initial_state, g_cumsum, Aqk, Akk, q_rstd, k_rstd, beta_act, cu_seqlens,
     cu_seqlens_cpu) = ctx.saved_tensors
    dht = dht if ctx.output_final_state else None
    dq, dk, dv, dg, dbeta, dh0, dA, dbias = torch.ops.titan_ext.chunk_kda_bwd(
        q, k, v, g, beta, A_log, dt_bias, initial_state, g_cumsum, Aqk, Akk, q_rstd, k_rstd, beta_act, do, dht,
        ctx.scale, *ctx.flags, cu_seqlens, cu_seqlens_cpu, ctx.chunk_size,
    )
    gate = ctx.flags[1]
    return (dq, dk, dv, dg, dbeta, dA if gate and A_log is not None else None,
            dbias if gate and dt_bias is not None else None, None, dh0 if initial_state is not None else None,
            *[None] * 11)


chunk_kda_fwd.register_autograd(_backward, setup_context=_setup_context)

SAVE_LIST = {torch.ops.titan_ext.chunk_kda_fwd.default}
"""What op-level SAC should keep of the KDA core: its forward's outputs (``o`` and what fla's backward reads)."""


def _check(q, k, v, g, beta, initial_state, cu_seqlens, use_gate_in_kernel, A_log, lower_bound, safe_gate,
           allow_neg_eigval, use_beta_sigmoid_in_kernel, chunk_size) -> None:
    """fla's argument checks, so the op refuses what ``chunk_kda`` refuses (as ValueError, with the fix)."""
    check_packed_states(q, initial_state, cu_seqlens)
    if use_gate_in_kernel and A_log is None and lower_bound is None:
        raise ValueError("use_gate_in_kernel=True needs A_log (or lower_bound for the sigmoid gate).")
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES} for KDA, not {chunk_size}.")
    if safe_gate and use_gate_in_kernel and (lower_bound is None or not -5 <= lower_bound < 0):
        raise ValueError(f"safe_gate=True with use_gate_in_kernel=True needs lower_bound in [-5, 0), not {lower_bound}.")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True needs use_beta_sigmoid_in_kernel=True.")
    B, T, H, K = q.shape
    HV = v.shape[2]
    if k.shape != q.shape or K > 256 or HV % H or v.shape[:2] != (B, T):
        raise ValueError(f"q and k must be [B, T, H, K<=256] and v [B, T, HV, V] with HV a multiple of H; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}.")
    if g.shape != (B, T, HV, K) or beta.shape != (B, T, HV):
        raise ValueError(f"g must be {[B, T, HV, K]} and beta {[B, T, HV]}; got {list(g.shape)} and {list(beta.shape)}.")


_FLA_ONLY_KEYWORDS = frozenset({"max_num_seqs", "transpose_state_layout"})
"""Keywords of fla's ``chunk_kda`` the ops do not take (CUDA graphs; a deprecated name): fla's own call."""


def _through_ops(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
    lower_bound=None, disable_recompute=False, return_intermediate_states=False, state_v_first=False,
    cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None, use_graph=False, **kwargs,
):
    """fla's ``chunk_kda`` (same arguments and returns) through ``titan_ext::chunk_kda_fwd``/``bwd``."""
    if cp_context is not None or disable_recompute or return_intermediate_states or use_graph or (
            _FLA_ONLY_KEYWORDS & kwargs.keys()):
        return compat.fla_kda_drivers().chunk_kda(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            safe_gate=safe_gate, lower_bound=lower_bound, disable_recompute=disable_recompute,
            return_intermediate_states=return_intermediate_states, state_v_first=state_v_first,
            cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, cp_context=cp_context, use_graph=use_graph, **kwargs,
        )
    A_log, dt_bias = (kwargs.get("A_log"), kwargs.get("dt_bias")) if use_gate_in_kernel else (None, None)
    chunk_size = kwargs.get("chunk_size", 64)
    _check(q, k, v, g, beta, initial_state, cu_seqlens, use_gate_in_kernel, A_log, lower_bound, safe_gate,
           allow_neg_eigval, use_beta_sigmoid_in_kernel, chunk_size)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o, ht, *_ = torch.ops.titan_ext.chunk_kda_fwd(
        q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
        use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate,
        None if lower_bound is None else float(lower_bound), state_v_first, cu_seqlens, cu_seqlens_cpu, chunk_size,
    )
    return o, (ht if output_final_state else None)


chunk_kda = with_local_args(_through_ops)
"""What titan_ext's KDA models call on the ``fla`` path instead of fla's ``chunk_kda`` (its ``KERNELS``)."""


KERNELS = (
    Kernel(
        "fla.ops.kda.chunk:chunk_kda", chunk_kda,
        "KDA's training kernel as torch ops around fla's own drivers: op-level SAC can save it and compile "
        "keeps it in the graph (fla's is a Triton autograd.Function behind torch.compiler.disable); " + TP_LOCAL,
        ("fla",),
    ),
)
"""What titan_ext's models call instead of fla's functions (``kernels.replacements``)."""
