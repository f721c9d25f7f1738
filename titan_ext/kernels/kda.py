"""fla's Kimi Delta Attention (KDA) core off CUDA: the chunked delta rule with a per-key-channel decay.

Same arguments and conventions as ``fla.ops.kda``'s ``chunk_kda`` and
``fused_recurrent_kda``: ``q``/``k`` are ``[B, T, H, K]``, ``v`` is ``[B, T, HV, V]``
(value head ``i`` reads query/key head ``i // (HV // H)``), the log decay ``g``
is ``[B, T, HV, K]`` (one per key channel, where Gated DeltaNet has one per
head), ``beta`` is ``[B, T, HV]``, states are ``[N, HV, K, V]`` (``[N, HV, V, K]``
with ``state_v_first``). What fla's ``KimiDeltaAttention`` asks the kernel to
fuse (L2-normalised q/k, the gate ``-exp(A_log) * softplus(g + dt_bias)`` or
its bounded form ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``,
``sigmoid(beta)``, doubled for negative eigenvalues) is applied first. With
``cu_seqlens`` (batch 1) each packed sequence runs from its own state.

The recurrence is ``S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``,
``o_t = S_t^T q_t``. Per chunk of ``C`` tokens with in-chunk cumulative log
decay ``G_t`` (a vector over key channels) and start state ``S``, the
corrections ``U`` solve one unit-lower-triangular system,
``(I + A) U = diag(beta) V - diag(beta) (K * exp(G)) S`` with
``A[t, s] = beta_t sum_d k_t[d] exp(G_t[d] - G_s[d]) k_s[d]`` for ``s < t``; then
``O = (Q * exp(G)) S + P U`` with ``P[t, s]`` the same decayed product of
``q_t`` and ``k_s`` for ``s <= t``, and the state moves on. The decay between
two tokens is taken pairwise (``exp`` of a difference that is at most 0), never
as a ratio of cumulative products, so long chunks and strong gates stay finite;
that costs a ``[C, C, K]`` tensor per chunk, hence a chunk shorter than fla's, and
the two products are recomputed in the backward instead of saving it (a checkpoint: what autograd keeps
is the size of ``q`` and ``k``). Autograd differentiates it; fla's naive recurrent form is the reference
in the tests.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import checkpoint

from titan_ext.kernels import delta_rule_op
from titan_ext.kernels.gated_delta import _softplus, delta_rule_inputs, run_delta_rule
from titan_ext.kernels.tp_local import local

CHUNK = 16
"""The portable kernel's chunk: its pairwise decays hold ``C * K`` numbers per token."""
FLA_CHUNK = 64
"""fla's ``chunk_kda`` chunk (what the FLOP count assumes)."""


def _scores(q, k, G, mask):
    """Per chunk (``[..., C, K]`` inputs), ``[..., t, s] = sum_d x_t[d] exp(G_t[d] - G_s[d]) k_s[d]`` for
    ``x = k`` and ``x = q``, over the pairs ``mask`` allows (else 0; masked before exp: no overflow)."""
    decay = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~mask.unsqueeze(-1), float("-inf")).exp()
    return torch.einsum("...tk,...tsk,...sk->...ts", k, decay, k), torch.einsum("...tk,...tsk,...sk->...ts", q, decay, k)


def _kda_rule(q, k, v, g, beta, state, sequence=None):
    """``[B, H, T, *]`` float32 (or float64) inputs (T a multiple of ``CHUNK``), state ``[B, H, K, V]`` -> (o, final state).

    ``sequence`` (``[T]``, batch 1): each token's packed sequence. A token then
    mixes only with tokens of its own sequence and reads the incoming chunk
    state only while its sequence began before the chunk; the final state is
    the last sequence's. One pass for any number of sequences.
    """
    B, H, T, K = k.shape
    n = T // CHUNK
    q, k, v, g = (x.reshape(B, H, n, CHUNK, -1) for x in (q, k, v, g))
    beta = beta.reshape(B, H, n, CHUNK)
    G = g.cumsum(-2)  # [B, H, n, C, K]
    mask = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    carry = torch.ones(n, CHUNK, dtype=q.dtype, device=q.device)
    if sequence is not None:
        seq = sequence.reshape(n, CHUNK)
        before = torch.cat([seq[:1, :1], seq[:-1, -1:]])  # the sequence of the token before each chunk
        mask = mask & (seq.unsqueeze(-1) == seq.unsqueeze(-2))
        carry = (seq == before).to(q.dtype)
    kk, qk = checkpoint(_scores, q, k, G, mask, use_reentrant=False)  # s <= t in one sequence
    eye = torch.eye(CHUNK, dtype=q.dtype, device=q.device)
    A = beta.unsqueeze(-1) * kk * (1 - eye)  # strictly lower
    solve = lambda rhs: torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)  # noqa: E731
    reads_state = G.exp() * carry.unsqueeze(-1)  # how much of the incoming state each token sees, per channel
    w_v = solve(beta.unsqueeze(-1) * v)  # U = w_v - w_k @ S
    w_k = solve(beta.unsqueeze(-1) * reads_state * k)
    # exp(G_last - G_s) for the chunk's last token's sequence, else 0
    to_last_token = (G[..., -1:, :] - G).masked_fill(~mask[..., -1, :].unsqueeze(-1), float("-inf")).exp()
    outputs = []
    for i in range(n):
        u = w_v[:, :, i] - w_k[:, :, i] @ state
        outputs.append((q[:, :, i] * reads_state[:, :, i]) @ state + qk[:, :, i] @ u)
        to_last = to_last_token[:, :, i]  # [B, H, C, K]
        state = reads_state[:, :, i, -1].unsqueeze(-1) * state + (to_last * k[:, :, i]).transpose(-1, -2) @ u
    return torch.stack(outputs, dim=2).reshape(B, H, T, -1), state


def kda_gate(g, A_log, dt_bias, lower_bound, dtype):
    """fla's in-kernel KDA gate, ``g`` ``[B, T, HV, K]`` raw -> log decay, at ``dtype``: under TP ``A_log``
    (``[HV]``) and ``dt_bias`` (``[HV * K]``) are DTensor shards of this rank's heads (``tp_local``)."""
    HV, K = g.shape[-2:]
    g = g.to(dtype)
    if dt_bias is not None:
        g = g + local(dt_bias).to(dtype).view(HV, K)
    a = None if A_log is None else local(A_log).to(dtype).view(HV, 1).exp()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(g if a is None else a * g)
    if a is None:
        raise ValueError("the KDA gate needs A_log unless lower_bound is set")
    return -a * _softplus(g)


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
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    **unused,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``chunk_kda`` in torch (``safe_gate`` is a speed hint of fla's kernel: the math is the same)."""
    if unused.get("cp_context") is not None:
        raise ValueError("KDA off CUDA does not support fla's context parallel (cp_context)")
    if unused.get("return_intermediate_states"):
        raise ValueError("KDA off CUDA does not return intermediate states")
    out_dtype = v.dtype
    q, k, v, beta = delta_rule_inputs(q, k, v, beta, scale, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                                      allow_neg_eigval)
    g = kda_gate(g, A_log, dt_bias, lower_bound, v.dtype) if use_gate_in_kernel else g.to(v.dtype)
    return delta_rule_op.delta_rule(_RULE, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                                    state_v_first, out_dtype)


_RULE = delta_rule_op.register_rule("kda", partial(run_delta_rule, _kda_rule, CHUNK))


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
    **options,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's decoding entry point (its own argument order); the math is the chunked form's."""
    for name in ("ssm_state_indices", "num_accepted_tokens", "out"):
        if options.pop(name, None) is not None:
            raise ValueError(f"KDA off CUDA does not support fused_recurrent_kda's {name}")
    options.pop("inplace_final_state", None)
    return chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, A_log=A_log, dt_bias=dt_bias,
                     **options)
