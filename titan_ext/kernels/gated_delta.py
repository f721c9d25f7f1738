"""fla's Gated DeltaNet core off CUDA: the chunked gated delta rule as plain torch ops.

Same arguments and conventions as ``fla.ops.gated_delta_rule``'s
``chunk_gated_delta_rule`` and ``fused_recurrent_gated_delta_rule``: ``q``/``k``
are ``[B, T, H, K]``, ``v`` is ``[B, T, HV, V]`` (grouped values: value head
``i`` reads query/key head ``i // (HV // H)``), ``g`` (log decay) and ``beta``
are ``[B, T, HV]``, states are ``[N, HV, K, V]`` (``[N, HV, V, K]`` with
``state_v_first``). The options fla's ``GatedDeltaNet`` layer asks its kernel
to fuse (L2-normalised q/k, the gate ``-exp(A_log) * softplus(g + dt_bias)``,
``sigmoid(beta)``, doubled for negative eigenvalues) are applied first.
With ``cu_seqlens`` (batch 1) each packed sequence runs from its own state.

Per chunk of ``C`` tokens with in-chunk cumulative decay ``G`` and start
state ``S``, the delta rule's corrections ``U`` solve one unit-lower-triangular
system, ``(I + A) U = diag(beta) V - diag(beta * exp(G)) K S`` with
``A[t, s] = beta_t exp(G_t - G_s) k_t.k_s`` for ``s < t``; then
``O = exp(G) * (Q S) + (QK^T * decay mask) U`` and the state moves on. The core
is one op to op-level SAC (``titan_ext.kernels.delta_rule_op``); autograd
differentiates it; fla's naive recurrent form is the reference in the tests.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from titan_ext.kernels import delta_rule_op
from titan_ext.kernels.tp_local import local
from titan_ext.kernels.varlen import check_packed_batch, sequence_spans, token_sequences

CHUNK = 64
L2NORM_EPS = 1e-6
"""fla's ``l2norm_fwd`` default."""


def _softplus(x: torch.Tensor) -> torch.Tensor:
    """``F.softplus`` (threshold 20) in elementwise ops: compiled (aot) backward graphs assume a
    contiguous ``softplus_backward`` output, which CPU's kernel does not give a strided gradient."""
    return torch.where(x > 20, x, torch.log1p(torch.exp(x.clamp(max=20))))


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + L2NORM_EPS)


def _delta_rule(q, k, v, g, beta, state, sequence=None):
    """``[B, H, T, *]`` float32 (or float64) inputs (T a multiple of ``CHUNK``), state ``[B, H, K, V]`` -> (o, final state).

    ``sequence`` (``[T]``, batch 1): each token's packed sequence. Then a token
    mixes only with tokens of its own sequence (``same``) and takes the incoming
    chunk state only while its sequence began before the chunk (``carry``);
    the final state is the last sequence's. One pass for any number of sequences.
    """
    B, H, T, K = k.shape
    n = T // CHUNK
    q, k, v = (x.reshape(B, H, n, CHUNK, -1) for x in (q, k, v))
    g, beta = (x.reshape(B, H, n, CHUNK) for x in (g, beta))
    G = g.cumsum(-1)
    mask = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    carry = torch.ones(n, CHUNK, dtype=q.dtype, device=q.device)
    if sequence is not None:
        seq = sequence.reshape(n, CHUNK)
        before = torch.cat([seq[:1, :1], seq[:-1, -1:]])  # the sequence of the token before each chunk
        mask = mask & (seq.unsqueeze(-1) == seq.unsqueeze(-2))
        carry = (seq == before).to(q.dtype)
    # exp(G_t - G_s) for s <= t in one sequence, else 0 (masked before exp: no overflow)
    decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~mask, float("-inf")).exp()
    eye = torch.eye(CHUNK, dtype=q.dtype, device=q.device)
    A = beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * decay * (1 - eye)  # strictly lower
    solve = lambda rhs: torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)  # noqa: E731
    reads_state = G.exp() * carry  # how much of the incoming state each token sees
    w_v = solve(beta.unsqueeze(-1) * v)  # U = w_v - w_k @ S
    w_k = solve((beta * reads_state).unsqueeze(-1) * k)
    qk = (q @ k.transpose(-1, -2)) * decay
    outputs = []
    for i in range(n):
        u = w_v[:, :, i] - w_k[:, :, i] @ state
        outputs.append(reads_state[:, :, i].unsqueeze(-1) * (q[:, :, i] @ state) + qk[:, :, i] @ u)
        to_last = decay[:, :, i, -1]  # exp(G_last - G_s) for the last token's sequence, else 0
        state = reads_state[:, :, i, -1:].unsqueeze(-1) * state + (to_last.unsqueeze(-1) * k[:, :, i]).transpose(-1, -2) @ u
    return torch.stack(outputs, dim=2).reshape(B, H, T, -1), state


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
    cu_seqlens: torch.Tensor | None = None,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    **unused,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``chunk_gated_delta_rule`` in torch; under TP, ``A_log``/``dt_bias`` are DTensor shards (``tp_local``)."""
    if unused.get("cp_context") is not None:
        raise ValueError("the gated delta rule off CUDA does not support context parallel (cp_context)")
    if unused.get("gk") is not None or unused.get("gv") is not None:
        raise ValueError("the gated delta rule off CUDA supports a per-head scalar gate g, not gk/gv")
    out_dtype = v.dtype
    q, k, v, beta = delta_rule_inputs(q, k, v, beta, scale, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                                      allow_neg_eigval)
    g = g.to(v.dtype)
    if use_gate_in_kernel:  # fla's gate, -exp(A_log) * softplus(g + dt_bias), at the working precision
        g = -local(A_log).to(v.dtype).exp() * _softplus(g if dt_bias is None else g + local(dt_bias).to(v.dtype))
    return delta_rule_op.delta_rule(_RULE, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                                    state_v_first, out_dtype)


def delta_rule_inputs(q, k, v, beta, scale, l2norm_qk: bool, beta_sigmoid: bool, allow_neg_eigval: bool):
    """What fla's delta-rule kernels (Gated DeltaNet's, KDA's) fuse before the recurrence, in torch: q, k, v and
    beta at the working precision (fp32; fp64 stays fp64), q and k L2-normalised if asked and repeated over
    grouped value heads, q scaled (default ``K ** -0.5``), ``sigmoid(beta)`` (doubled for negative eigenvalues)."""
    H, HV = q.shape[2], v.shape[2]
    if HV % H:
        raise ValueError(f"num_v_heads (HV={HV}) must be divisible by num_heads (H={H})")
    if scale is None:
        scale = k.shape[-1] ** -0.5
    wide = torch.promote_types(v.dtype, torch.float32)  # fla computes in fp32; fp64 inputs stay fp64
    q, k = q.to(wide), k.to(wide)
    if l2norm_qk:
        q, k = _l2norm(q), _l2norm(k)
    if HV > H:
        q, k = (x.repeat_interleave(HV // H, dim=2) for x in (q, k))
    beta = beta.to(wide)
    if beta_sigmoid:
        beta = beta.sigmoid() * (2.0 if allow_neg_eigval else 1.0)
    return q * scale, k, v.to(wide), beta


def run_delta_rule(rule, chunk, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, state_v_first,
                   out_dtype):
    """What the chunked delta rules (Gated DeltaNet's, KDA's) share around their ``rule``: spans padded to
    whole chunks of ``chunk`` tokens, packed sequences in one pass (training) or one by one (states given or
    wanted), states in fla's layout. ``rule(q, k, v, g, beta, state, sequence)`` takes ``[B, H, T, *]``
    spans; inputs are ``[B, T, H, *]``, already scaled and at the working precision."""
    h0 = initial_state
    if h0 is not None:
        h0 = h0.to(q.dtype).transpose(-1, -2) if state_v_first else h0.to(q.dtype)

    def run(span, state, sequence=None):
        """``[B, T, H, *]`` slices -> (o ``[B, H, T, V]``, final state); ``sequence``: packed sequences in the slice."""
        T = q[:, span].shape[1]
        pad = -T % chunk  # padded tokens: zero k, v, beta and log decay leave the state untouched
        qs, ks, vs, gs, bs = (F.pad(x[:, span].transpose(1, 2), (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
                              for x in (q, k, v, g, beta))
        if sequence is not None:
            sequence = torch.cat([sequence, sequence[-1:].expand(pad)])
        if state is None:
            state = qs.new_zeros(qs.shape[0], vs.shape[1], ks.shape[-1], vs.shape[-1])
        o, state = rule(qs, ks, vs, gs, bs, state, sequence)
        return o[:, :, :T], state

    if cu_seqlens is None:
        o, ht = run(slice(None), h0)
    elif h0 is None and not output_final_state:  # training: every packed sequence from zero, in one pass
        check_packed_batch(q.shape[0])
        o, ht = run(slice(None), None, token_sequences(cu_seqlens, q.shape[1])[0])
    else:  # each packed sequence from its own initial state, or with its own final state
        o, ht = _each_sequence(run, cu_seqlens, h0, q.shape[0])
    o = o.transpose(1, 2).to(out_dtype)
    final = (ht.transpose(-1, -2) if state_v_first else ht) if output_final_state else None
    return o, final


@torch.compiler.disable  # a loop over the sequences: one graph break, instead of a recompile per document count
def _each_sequence(run, cu_seqlens, h0, batch_size):
    spans = sequence_spans(cu_seqlens, batch_size=batch_size)
    runs = [run(slice(bos, eos), None if h0 is None else h0[n : n + 1]) for n, (bos, eos) in enumerate(spans)]
    return torch.cat([o for o, _ in runs], dim=2), torch.cat([h for _, h in runs], dim=0)


_RULE = delta_rule_op.register_rule("gated_delta", partial(run_delta_rule, _delta_rule, CHUNK))


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
    **options,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's decoding entry point (its own argument order); the math is the chunked form's."""
    if g is None or beta is None:
        raise ValueError("the gated delta rule off CUDA needs both g and beta")
    return chunk_gated_delta_rule(
        q, k, v, g, beta, scale, initial_state, output_final_state, gk=gk, gv=gv, **options
    )
