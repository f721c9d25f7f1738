"""fla's Gated DeltaNet entry points off CUDA: ``chunk_gated_delta_rule`` and ``fused_recurrent_gated_delta_rule``.

Same parameters as fla 0.6.0's, names and defaults (the keys fla reads from ``**kwargs`` listed as
keyword-only: ``kernels.signature``), and fla's conventions: ``q``/``k`` are ``[B, T, H, K]``, ``v`` is
``[B, T, HV, V]`` (grouped values: value head ``i`` reads query/key head ``i // (HV // H)``), ``g`` (log
decay) and ``beta`` are ``[B, T, HV]``, states are ``[N, HV, K, V]`` (``[N, HV, V, K]`` with
``state_v_first``, or its deprecated alias ``transpose_state_layout``). The options fla's ``GatedDeltaNet``
layer asks its kernel to fuse (L2-normalised q/k, the gate ``-exp(A_log) * softplus(g + dt_bias)``,
``sigmoid(beta)``, doubled for negative eigenvalues) are applied first. With ``cu_seqlens`` (batch 1) each
packed sequence runs from its own state. What fla checks, these check (same messages); what they do not
honour (fla's ``cp_context``) is refused in one line.

The recurrence (``delta_rules``: the chunked core, one op to op-level SAC) is what
``titan_ext.kernels.state_passing`` calls ``AffineState``.
"""

from __future__ import annotations

import torch

from titan_ext.kernels import delta_rule_op, signature
from titan_ext.kernels.delta_rules import (  # noqa: F401  (CHUNK, softplus: read by the models' FLOPs and layers)
    CHUNK,
    KEY_DECAY,
    SCALAR_DECAY,
    SCALAR_DECAY_SIZES,
    delta_rule_inputs,
    gdn_gate,
    recurrent_delta_rule,
    run_delta_rule,
    softplus as _softplus,
)
from titan_ext.kernels.signature import ABSENT, check_neg_eigval, check_varlen, refuse
from titan_ext.kernels.table import TRITON, Kernel

_CP = "titan_ext's context parallelism passes the states between ranks itself (kernels.state_passing)"


def _check_heads(q, k, v) -> None:
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same number of heads, but got q.shape[2]={q.shape[2]} and "
                         f"k.shape[2]={k.shape[2]}")
    H, HV = q.shape[2], v.shape[2]
    if HV % H != 0:
        raise ValueError(f"For GVA, num_v_heads (HV={HV}) must be evenly divisible by num_heads (H={H}), but got "
                         f"HV % H = {HV % H}")


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    cp_context=None,
    *,
    transpose_state_layout=ABSENT,
    head_first=ABSENT,
    chunk_size: int = 64,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``chunk_gated_delta_rule`` in torch; under TP, ``A_log``/``dt_bias`` are DTensor shards (``tp_local``).

    ``chunk_size`` (16, 32 or 64, as fla) is the chunk the core runs; ``cu_seqlens_cpu`` and
    ``chunk_indices`` are fla's precomputed forms of ``cu_seqlens`` (read from ``cu_seqlens`` here).
    """
    state_v_first = signature.state_v_first(state_v_first, transpose_state_layout)
    _check_heads(q, k, v)
    signature.no_head_first(head_first)
    signature.check_chunk_size("Gated Delta Rule", chunk_size, SCALAR_DECAY_SIZES)
    if cp_context is not None:
        refuse("chunk_gated_delta_rule", "fla's context parallel (cp_context)", _CP)
    check_varlen(q, initial_state, cu_seqlens)
    if use_gate_in_kernel and A_log is None:
        raise ValueError("A_log must be provided when use_gate_in_kernel=True.")
    check_neg_eigval(allow_neg_eigval, use_beta_sigmoid_in_kernel)
    out_dtype = v.dtype
    q, k, v, beta = delta_rule_inputs(q, k, v, beta, scale, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                                      allow_neg_eigval)
    g = gdn_gate(g, A_log, dt_bias, v.dtype) if use_gate_in_kernel else g.to(v.dtype)
    return delta_rule_op.delta_rule(SCALAR_DECAY[chunk_size], q, k, v, g, beta, initial_state, output_final_state,
                                    cu_seqlens, state_v_first, out_dtype)


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    *,
    transpose_state_layout=ABSENT,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's decoding entry point (its own argument order), every gate it takes: a scalar ``g`` per head
    (raw, with ``use_gate_in_kernel``), a per-key ``gk`` and a per-value ``gv`` log decay (``[B, T, HV, K]``,
    ``[B, T, HV, V]``), each optional; ``beta`` per head or per value (``[B, T, HV, V]``), ones if absent.

    The chunked cores run what they can express (no ``gv``, ``beta`` per head: the scalar-decay core, or the
    per-key one when ``gk`` is given); the rest runs token by token.
    """
    state_v_first = signature.state_v_first(state_v_first, transpose_state_layout)
    check_varlen(q, initial_state, cu_seqlens)
    if beta is None:
        beta = torch.ones(v.shape[:3], dtype=v.dtype, device=v.device)
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True`.")
        if g is None:
            raise ValueError("`g` (raw pre-activation) must be provided when `use_gate_in_kernel=True`.")
    check_neg_eigval(allow_neg_eigval, use_beta_sigmoid_in_kernel)
    out_dtype = v.dtype
    q, k, v, beta = delta_rule_inputs(q, k, v, beta, scale, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                                      allow_neg_eigval)
    wide = v.dtype
    if g is not None:
        g = gdn_gate(g, A_log, dt_bias, wide) if use_gate_in_kernel else g.to(wide)
    gk = None if gk is None else gk.to(wide)
    gv = None if gv is None else gv.to(wide)
    if gv is None and beta.dim() == 3:
        if gk is None:
            g = torch.zeros(v.shape[:3], dtype=wide, device=v.device) if g is None else g
            rule = SCALAR_DECAY[CHUNK]
        else:
            g, rule = (gk if g is None else gk + g.unsqueeze(-1)), KEY_DECAY
        return delta_rule_op.delta_rule(rule, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                                        state_v_first, out_dtype)
    return recurrent_delta_rule(q, k, v, beta, g, gk, gv, initial_state, output_final_state, cu_seqlens,
                                state_v_first, out_dtype)


KERNELS = (
    Kernel("fla.ops.gated_delta_rule.chunk:chunk_gated_delta_rule", chunk_gated_delta_rule, TRITON),
    Kernel(
        "fla.ops.gated_delta_rule.fused_recurrent:fused_recurrent_gated_delta_rule", fused_recurrent_gated_delta_rule,
        TRITON,
    ),
)
"""What titan_ext's models call instead of fla's functions (``kernels.replacements``)."""

SIGNATURES = {
    "fla.ops.gated_delta_rule.chunk:chunk_gated_delta_rule":
        "q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, "
        "use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, "
        "state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, cp_context=None, "
        "**kwargs",
    "fla.ops.gated_delta_rule.fused_recurrent:fused_recurrent_gated_delta_rule":
        "q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None, "
        "output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, "
        "dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False, "
        "cu_seqlens=None, **kwargs",
}
"""Parameters (``name=default``) of the functions replaced or called by keyword, as written against them
(``host.checks.check_fla_signatures``)."""
