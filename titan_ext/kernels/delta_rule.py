"""fla's plain delta rule (DeltaNet) off CUDA: ``chunk_delta_rule`` and ``fused_recurrent_delta_rule``.

``S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, ``o_t = S_t^T q_t``: Gated DeltaNet's recurrence
without its decay, so ``delta_rules``' scalar-decay core with a zero log decay (``AffineState`` in
``titan_ext.kernels.state_passing``'s terms: the transition is a full ``K x K`` matrix). Same parameters as
fla 0.6.0's (``kernels.signature``): ``q``/``k``/``v`` ``[B, T, H, *]``, ``beta`` ``[B, T, H]`` (``[B, T, H, V]``
per value for ``fused_recurrent_delta_rule``, token by token), states ``[N, H, K, V]``; fla's checks, fla's
messages. fla's chunked kernel refuses fp32 inputs (a Triton limit); this one computes in fp32 anyway and
takes them.
"""

from __future__ import annotations

import torch

from titan_ext.kernels import delta_rule_op, signature
from titan_ext.kernels.delta_rules import SCALAR_DECAY, SCALAR_DECAY_SIZES, delta_rule_inputs, recurrent_delta_rule
from titan_ext.kernels.signature import ABSENT, check_varlen
from titan_ext.kernels.table import TRITON, Kernel


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    *,
    head_first=ABSENT,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``chunk_delta_rule`` in torch (``AffineState``); ``chunk_size`` (16, 32 or 64, as fla) is the
    chunk the core runs."""
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if beta.dim() != 3:
        raise ValueError("beta must be of shape (batch size, seq len, num of head).")
    signature.no_head_first(head_first)
    signature.check_chunk_size("the delta rule", chunk_size, SCALAR_DECAY_SIZES)
    check_varlen(q, initial_state, cu_seqlens)
    out_dtype = v.dtype
    q, k, v, beta = delta_rule_inputs(q, k, v, beta, scale, use_qk_l2norm_in_kernel, False, False)
    g = torch.zeros_like(beta)
    return delta_rule_op.delta_rule(SCALAR_DECAY[chunk_size], q, k, v, g, beta, initial_state, output_final_state,
                                    cu_seqlens, False, out_dtype)


def fused_recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor = None,
    scale: float = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``fused_recurrent_delta_rule`` (``AffineState``): ``beta`` ones if absent, per head (the chunked
    core) or per value (``[B, T, H, V]``, token by token); ``scale`` must be positive, as fla asserts."""
    check_varlen(q, initial_state, cu_seqlens)
    if scale is not None and not scale > 0:
        raise ValueError("scale must be positive")
    if beta is None:
        beta = torch.ones(v.shape[:3], dtype=v.dtype, device=v.device)
    out_dtype = v.dtype
    q, k, v, beta = delta_rule_inputs(q, k, v, beta, scale, use_qk_l2norm_in_kernel, False, False)
    if beta.dim() == 3:
        return delta_rule_op.delta_rule(SCALAR_DECAY[64], q, k, v, torch.zeros_like(beta), beta, initial_state,
                                        output_final_state, cu_seqlens, False, out_dtype)
    return recurrent_delta_rule(q, k, v, beta, None, None, None, initial_state, output_final_state, cu_seqlens, False,
                                out_dtype)


KERNELS = (
    Kernel("fla.ops.delta_rule.chunk:chunk_delta_rule", chunk_delta_rule, "fla's DeltaNet layer: " + TRITON),
    Kernel(
        "fla.ops.delta_rule.fused_recurrent:fused_recurrent_delta_rule", fused_recurrent_delta_rule,
        "fla's DeltaNet and Gated DeltaProduct layers (decoding): " + TRITON,
    ),
)
"""What titan_ext's models call instead of fla's functions (``kernels.replacements``)."""

SIGNATURES = {
    "fla.ops.delta_rule.chunk:chunk_delta_rule":
        "q, k, v, beta, scale=None, initial_state=None, output_final_state=False, "
        "use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs",
    "fla.ops.delta_rule.fused_recurrent:fused_recurrent_delta_rule":
        "q, k, v, beta=None, scale=None, initial_state=None, output_final_state=False, "
        "use_qk_l2norm_in_kernel=False, cu_seqlens=None",
}
"""Parameters (``name=default``) of the functions replaced or called by keyword, as written against them
(``host.checks.check_fla_signatures``)."""
