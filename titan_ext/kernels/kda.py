"""fla's Kimi Delta Attention (KDA) entry points off CUDA: ``chunk_kda`` and ``fused_recurrent_kda``.

Same parameters as fla 0.6.0's, names and defaults (the keys fla reads from ``**kwargs`` listed as
keyword-only: ``kernels.signature``), and fla's conventions: ``q``/``k`` are ``[B, T, H, K]``, ``v`` is
``[B, T, HV, V]`` (value head ``i`` reads query/key head ``i // (HV // H)``), the log decay ``g`` is
``[B, T, HV, K]`` (one per key channel, where Gated DeltaNet has one per head), ``beta`` is ``[B, T, HV]``,
states are ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``, or its deprecated alias
``transpose_state_layout``). What fla's ``KimiDeltaAttention`` asks the kernel to fuse (L2-normalised q/k,
the gate ``-exp(A_log) * softplus(g + dt_bias)`` or its bounded form
``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``, ``sigmoid(beta)``, doubled for negative eigenvalues)
is applied first. With ``cu_seqlens`` (batch 1) each packed sequence runs from its own state.

The recurrence is ``S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``,
``o_t = S_t^T q_t``: ``delta_rules``' per-key-decay core (chunk ``KDA_CHUNK``: its pairwise decays hold
``C * K`` numbers per token; fla's ``chunk_size``, 32 or 64, only tiles fla's kernel, and is checked as fla
checks it). ``titan_ext.kernels.state_passing`` calls it ``AffineState``.
"""

from __future__ import annotations

import torch

from titan_ext.kernels import delta_rule_op, signature
from titan_ext.kernels.delta_rules import KDA_CHUNK, KEY_DECAY, delta_rule_inputs, kda_gate, recurrent_delta_rule
from titan_ext.kernels.signature import ABSENT, check_neg_eigval, check_varlen, refuse
from titan_ext.kernels.table import TRITON, Kernel

CHUNK = KDA_CHUNK
"""The portable kernel's chunk: its pairwise decays hold ``C * K`` numbers per token."""
FLA_CHUNK = 64
"""fla's ``chunk_kda`` chunk (what the FLOP count assumes)."""
CHUNK_SIZES = (32, 64)
"""The chunk sizes fla's ``chunk_kda`` takes."""

_CP = "titan_ext's context parallelism passes the states between ranks itself (kernels.state_passing)"


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    *,
    transpose_state_layout=ABSENT,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``chunk_kda`` in torch.

    Speed and memory hints of fla's kernel change nothing here (the math is the same): ``safe_gate`` (a
    bounded gate, checked as fla checks it), ``disable_recompute``, ``use_graph`` with ``max_num_seqs`` (CUDA/NPU
    graph capture; fla's check of the sequence count is kept), ``cu_seqlens_cpu``, ``chunk_size``.
    """
    state_v_first = signature.state_v_first(state_v_first, transpose_state_layout)
    if cp_context is not None:
        refuse("chunk_kda", "fla's context parallel (cp_context)", _CP)
    if return_intermediate_states:
        refuse("chunk_kda", "return_intermediate_states", "it returns no per-chunk states")
    check_varlen(q, initial_state, cu_seqlens)
    if use_graph and cu_seqlens is not None and max_num_seqs is not None and cu_seqlens.shape[0] - 1 != max_num_seqs:
        raise ValueError(f"use_graph: cu_seqlens must hold max_num_seqs + 1 entries, got {cu_seqlens.shape[0] - 1} "
                         f"sequences with max_num_seqs={max_num_seqs}")
    if not use_gate_in_kernel:
        A_log, dt_bias = None, None
    elif A_log is None and lower_bound is None:
        raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set.")
    signature.check_chunk_size("KDA", chunk_size, CHUNK_SIZES)
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise ValueError("`lower_bound` must be specified when `safe_gate=True` and `use_gate_in_kernel=True`.")
        if not (-5 <= lower_bound < 0):
            raise ValueError(f"`lower_bound` must be in the safe range [-5, 0), got {lower_bound}.")
    check_neg_eigval(allow_neg_eigval, use_beta_sigmoid_in_kernel)
    B, T, H, K, HV = *q.shape, v.shape[2]
    if q.shape != k.shape or K > 256 or HV % H:
        raise ValueError(f"q and k must be [B, T, H, K<=256] and v [B, T, HV, V] with HV a multiple of H; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}.")
    if g.shape != (B, T, HV, K) or beta.shape != (B, T, HV):
        raise ValueError(f"g must have shape [B, T, HV, K]={[B, T, HV, K]} and beta [B, T, HV]={[B, T, HV]}, got "
                         f"{list(g.shape)} and {list(beta.shape)}")
    out_dtype = v.dtype
    q, k, v, beta = delta_rule_inputs(q, k, v, beta, scale, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                                      allow_neg_eigval)
    g = kda_gate(g, A_log, dt_bias, lower_bound, v.dtype) if use_gate_in_kernel else g.to(v.dtype)
    return delta_rule_op.delta_rule(KEY_DECAY, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                                    state_v_first, out_dtype)


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    *,
    transpose_state_layout=ABSENT,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's decoding entry point (its own argument order); ``beta`` per head or per value
    (``[B, T, HV, V]``, token by token). The chunked form's math otherwise."""
    state_v_first = signature.state_v_first(state_v_first, transpose_state_layout)
    check_varlen(q, initial_state, cu_seqlens)
    check_neg_eigval(allow_neg_eigval, use_beta_sigmoid_in_kernel)
    if use_gate_in_kernel and A_log is None and lower_bound is None:
        refuse("fused_recurrent_kda", "use_gate_in_kernel=True without A_log or lower_bound",
               "fla's kernel then reads A_log as 1.0 (-e * softplus(g)); pass A_log")
    out_dtype = v.dtype
    q, k, v, beta = delta_rule_inputs(q, k, v, beta, scale, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                                      allow_neg_eigval)
    g = kda_gate(g, A_log, dt_bias, lower_bound, v.dtype) if use_gate_in_kernel else g.to(v.dtype)
    if beta.dim() == 3:
        return delta_rule_op.delta_rule(KEY_DECAY, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                                        state_v_first, out_dtype)
    return recurrent_delta_rule(q, k, v, beta, None, g, None, initial_state, output_final_state, cu_seqlens,
                                state_v_first, out_dtype)


KERNELS = (
    Kernel("fla.ops.kda.chunk:chunk_kda", chunk_kda, TRITON),
    Kernel("fla.ops.kda.fused_recurrent:fused_recurrent_kda", fused_recurrent_kda, TRITON),
)
"""What titan_ext's models call instead of fla's functions (``kernels.replacements``)."""

SIGNATURES = {
    "fla.ops.kda.chunk:chunk_kda":
        "q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, "
        "use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, "
        "allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False, "
        "return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, "
        "cp_context=None, use_graph=False, max_num_seqs=None, **kwargs",
    "fla.ops.kda.fused_recurrent:fused_recurrent_kda":
        "q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None, output_final_state=False, "
        "use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, "
        "allow_neg_eigval=False, lower_bound=None, state_v_first=False, cu_seqlens=None, **kwargs",
}
"""Parameters (``name=default``) of the functions replaced or called by keyword, as written against them
(``host.checks.check_fla_signatures``)."""
