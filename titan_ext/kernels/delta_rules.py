"""The delta-rule cores the portable kernels share (fla's Gated DeltaNet, KDA and plain delta rule), in torch.

One recurrence, ``S_t = (I - beta_t k_t k_t^T) D_t S_{t-1} + beta_t k_t v_t^T`` and ``o_t = S_t^T q_t``, its
decay ``D_t`` either one scalar per head (``exp(g_t)``: Gated DeltaNet; none: the plain delta rule) or one
per key channel (``Diag(exp(g_t))``: KDA). Two chunked cores, each one op to op-level SAC
(``delta_rule_op``, rules registered here by name), and a token-by-token loop for what fla's
``fused_recurrent`` kernels take beyond them (a per-value decay ``gv``, a per-value ``beta``):

* scalar decay (``_delta_rule``): per chunk of ``C`` tokens with in-chunk cumulative decay ``G`` and start
  state ``S``, the corrections ``U`` solve one unit-lower-triangular system,
  ``(I + A) U = diag(beta) V - diag(beta * exp(G)) K S`` with ``A[t, s] = beta_t exp(G_t - G_s) k_t.k_s``
  for ``s < t``; then ``O = exp(G) * (Q S) + (QK^T * decay mask) U``. The chunk is fla's ``chunk_size``
  (16, 32 or 64: the same math, tiled differently);
* per-key decay (``_kda_rule``): the same with ``exp(G_t[d] - G_s[d])`` inside the key products, taken
  pairwise (``exp`` of a difference at most 0, never a ratio of cumulative products), which costs a
  ``[C, C, K]`` tensor per chunk: a chunk of 16, and the products recomputed in backward (a checkpoint).

The state is what ``titan_ext.kernels.state_passing`` calls ``AffineState`` (its transition is a full
``K x K`` matrix). Autograd differentiates every core; fla's naive recurrent forms are the tests' references.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from titan_ext.kernels import delta_rule_op
from titan_ext.kernels.tp_local import local
from titan_ext.kernels.varlen import check_packed_batch, sequence_spans, token_sequences

CHUNK = 64
"""The scalar-decay core's default chunk (fla's ``chunk_size`` default)."""
KDA_CHUNK = 16
"""The per-key-decay core's chunk: its pairwise decays hold ``C * K`` numbers per token."""
L2NORM_EPS = 1e-6
"""fla's ``l2norm_fwd`` default."""


def softplus(x: torch.Tensor) -> torch.Tensor:
    """``F.softplus`` (threshold 20) in elementwise ops: compiled (aot) backward graphs assume a
    contiguous ``softplus_backward`` output, which CPU's kernel does not give a strided gradient."""
    return torch.where(x > 20, x, torch.log1p(torch.exp(x.clamp(max=20))))


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + L2NORM_EPS)


def _sequence_masks(sequence, n, chunk, dtype, device):
    """The in-chunk causal mask and each token's share of the incoming chunk state, with ``sequence``
    (``[T]``, batch 1): a token mixes only with tokens of its own sequence, and takes the incoming state only
    while its sequence began before the chunk."""
    mask = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril()
    carry = torch.ones(n, chunk, dtype=dtype, device=device)
    if sequence is not None:
        seq = sequence.reshape(n, chunk)
        before = torch.cat([seq[:1, :1], seq[:-1, -1:]])  # the sequence of the token before each chunk
        mask = mask & (seq.unsqueeze(-1) == seq.unsqueeze(-2))
        carry = (seq == before).to(dtype)
    return mask, carry


def _delta_rule(q, k, v, g, beta, state, sequence=None, chunk=CHUNK):
    """``[B, H, T, *]`` float32 (or float64) inputs (T a multiple of ``chunk``), state ``[B, H, K, V]`` -> (o, final state).

    ``sequence`` (``[T]``, batch 1): each token's packed sequence; one pass for any number of sequences, the
    final state the last sequence's.
    """
    B, H, T, K = k.shape
    n = T // chunk
    q, k, v = (x.reshape(B, H, n, chunk, -1) for x in (q, k, v))
    g, beta = (x.reshape(B, H, n, chunk) for x in (g, beta))
    G = g.cumsum(-1)
    mask, carry = _sequence_masks(sequence, n, chunk, q.dtype, q.device)
    # exp(G_t - G_s) for s <= t in one sequence, else 0 (masked before exp: no overflow)
    decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~mask, float("-inf")).exp()
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
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


def _kda_scores(q, k, G, mask):
    """Per chunk (``[..., C, K]`` inputs), ``[..., t, s] = sum_d x_t[d] exp(G_t[d] - G_s[d]) k_s[d]`` for
    ``x = k`` and ``x = q``, over the pairs ``mask`` allows (else 0; masked before exp: no overflow)."""
    decay = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~mask.unsqueeze(-1), float("-inf")).exp()
    return torch.einsum("...tk,...tsk,...sk->...ts", k, decay, k), torch.einsum("...tk,...tsk,...sk->...ts", q, decay, k)


def _kda_rule(q, k, v, g, beta, state, sequence=None):
    """``[B, H, T, *]`` float32 (or float64) inputs (T a multiple of ``KDA_CHUNK``), ``g`` ``[B, H, T, K]``,
    state ``[B, H, K, V]`` -> (o, final state); ``sequence`` as ``_delta_rule``'s."""
    B, H, T, K = k.shape
    C = KDA_CHUNK
    n = T // C
    q, k, v, g = (x.reshape(B, H, n, C, -1) for x in (q, k, v, g))
    beta = beta.reshape(B, H, n, C)
    G = g.cumsum(-2)  # [B, H, n, C, K]
    mask, carry = _sequence_masks(sequence, n, C, q.dtype, q.device)
    kk, qk = checkpoint(_kda_scores, q, k, G, mask, use_reentrant=False)  # s <= t in one sequence
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
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


def delta_rule_inputs(q, k, v, beta, scale, l2norm_qk: bool, beta_sigmoid: bool, allow_neg_eigval: bool):
    """What fla's delta-rule kernels fuse before the recurrence, in torch: q, k, v and beta at the working
    precision (fp32; fp64 stays fp64), q and k L2-normalised if asked and repeated over grouped value heads,
    q scaled (default ``K ** -0.5``), ``sigmoid(beta)`` (doubled for negative eigenvalues)."""
    H, HV = q.shape[2], v.shape[2]
    if HV % H:
        raise ValueError(f"num_v_heads (HV={HV}) must be divisible by num_heads (H={H})")
    if scale is None:
        scale = k.shape[-1] ** -0.5
    wide = torch.promote_types(v.dtype, torch.float32)  # fla computes in fp32; fp64 inputs stay fp64
    q, k = q.to(wide), k.to(wide)
    if l2norm_qk:
        q, k = l2norm(q), l2norm(k)
    if HV > H:
        q, k = (x.repeat_interleave(HV // H, dim=2) for x in (q, k))
    beta = beta.to(wide)
    if beta_sigmoid:
        beta = beta.sigmoid() * (2.0 if allow_neg_eigval else 1.0)
    return q * scale, k, v.to(wide), beta


def gdn_gate(g, A_log, dt_bias, dtype):
    """fla's in-kernel Gated DeltaNet gate, ``-exp(A_log) * softplus(g + dt_bias)`` (``[B, T, HV]``), at
    ``dtype``; under TP ``A_log``/``dt_bias`` are DTensor shards of this rank's heads (``tp_local``)."""
    g = g.to(dtype)
    return -local(A_log).to(dtype).exp() * softplus(g if dt_bias is None else g + local(dt_bias).to(dtype))


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
    return -a * softplus(g)


def run_delta_rule(rule, chunk, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, state_v_first,
                   out_dtype):
    """What the chunked cores share around their ``rule``: spans padded to whole chunks of ``chunk`` tokens,
    packed sequences in one pass (training) or one by one (states given or wanted), states in fla's layout.
    ``rule(q, k, v, g, beta, state, sequence)`` takes ``[B, H, T, *]`` spans; inputs are ``[B, T, H, *]``,
    already scaled and at the working precision."""
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


SCALAR_DECAY_SIZES = (16, 32, 64)
SCALAR_DECAY = {c: delta_rule_op.register_rule("gated_delta" if c == CHUNK else f"gated_delta@{c}",
                                               partial(run_delta_rule, partial(_delta_rule, chunk=c), c))
                for c in SCALAR_DECAY_SIZES}
"""chunk size -> the scalar-decay core's rule name (``delta_rule_op``)."""
KEY_DECAY = delta_rule_op.register_rule("kda", partial(run_delta_rule, _kda_rule, KDA_CHUNK))
"""The per-key-decay core's rule name."""


def recurrent_delta_rule(q, k, v, beta, g, gk, gv, initial_state, output_final_state, cu_seqlens, state_v_first,
                         out_dtype):
    """fla's ``fused_recurrent`` delta rules token by token, for what the chunked cores do not take: ``[B, T,
    H, *]`` inputs at the working precision (q scaled, grouped heads repeated), ``beta`` ``[B, T, H]`` or per
    value ``[B, T, H, V]``, log decays ``g`` ``[B, T, H]``, ``gk`` ``[B, T, H, K]``, ``gv`` ``[B, T, H, V]``
    (each optional), applied to the state in that order before the delta update."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    h0 = initial_state
    if h0 is not None:
        h0 = h0.to(q.dtype).transpose(-1, -2) if state_v_first else h0.to(q.dtype)
    spans = [(0, T)] * B if cu_seqlens is None else sequence_spans(cu_seqlens, batch_size=B)
    outputs, finals = [], []
    for n, (bos, eos) in enumerate(spans):
        row = n if cu_seqlens is None else 0
        h = q.new_zeros(H, K, V) if h0 is None else h0[n]
        for t in range(bos, eos):
            if g is not None:
                h = h * g[row, t].exp()[:, None, None]
            if gk is not None:
                h = h * gk[row, t].exp()[:, :, None]
            if gv is not None:
                h = h * gv[row, t].exp()[:, None, :]
            b = beta[row, t] if beta.dim() == 4 else beta[row, t][:, None]
            u = b * (v[row, t] - (k[row, t][:, :, None] * h).sum(1))  # [H, V]
            h = h + k[row, t][:, :, None] * u[:, None, :]
            outputs.append((q[row, t][:, :, None] * h).sum(1))
        finals.append(h)
    if not outputs:
        o = v.new_zeros(B, T, H, V)
    else:
        o = torch.stack(outputs).reshape(B, T, H, V) if cu_seqlens is None else torch.stack(outputs).unsqueeze(0)
    ht = torch.stack(finals)
    final = (ht.transpose(-1, -2) if state_v_first else ht) if output_final_state else None
    return o.to(out_dtype), final
