"""Torch-native Gated Linear Attention, for tensors that fla's Triton kernels cannot run on.

GLA keeps a per-head state ``h`` of shape ``[K, V]`` and, for every token ``t``::

    h_t = diag(exp(gk_t)) @ h_{t-1} @ diag(exp(gv_t)) + k_t^T v_t
    o_t = scale * q_t @ h_t

where ``gk``/``gv`` are log-space decays (GLA feeds ``logsigmoid(x) / 16``, so
they are <= 0). A per-token Python loop is slow, so tokens are grouped into
chunks of ``CHUNK_SIZE``: inside a chunk the outputs come from a small masked
"attention" matrix, and only the state is carried from chunk to chunk.

Numerical stability: every decay is ``exp`` of a *difference* of within-chunk
cumulative log-decays taken in the direction in which it is <= 0 (token ``j``
to a later token ``i``, chunk start to ``i``, ``j`` to chunk end). Nothing
calls ``exp`` on a large positive number, whatever the gate values. The math
runs in fp32 (or fp64 for fp64 inputs) and uses plain differentiable torch ops,
so autograd supplies the backward pass and ``torch.compile`` can trace it.

The public functions take fla 0.6's parameters (``chunk_gla``, ``fused_recurrent_gla``; ``fused_chunk_gla``
takes ``chunk_gla``'s): inputs ``[B, T, H, K]`` / ``[B, T, H, V]``, states
``[N, H, K, V]`` (``[N, H, V, K]`` with ``state_v_first``), outputs
``(o, final_state)`` with ``o`` in the input dtype and the state in fp32.

The state decays per key channel (and per value channel with ``gv``): what
``titan_ext.kernels.state_passing`` calls ``DiagonalDecay``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_ext.kernels import signature
from titan_ext.kernels.signature import ABSENT, check_varlen
from titan_ext.kernels.table import TRITON, Kernel
from titan_ext.kernels.varlen import sequence_spans

CHUNK_SIZE = 16


def fla_chunk_size(seq_len: int) -> int:
    """The chunk fla's ``chunk_gla`` uses for ``seq_len`` tokens: the next power of two, clamped to [16, 64]."""
    size = 16
    while size < seq_len and size < 64:
        size *= 2
    return size


def _chunked_recurrence(q, k, v, gk, gv, h0, chunk_size):
    """Run the recurrence for ``[B, H, T, *]`` inputs (q already scaled); return ``o, h_T``."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    h = h0 if h0 is not None else q.new_zeros(B, H, K, V)
    if T == 0:
        return v.new_zeros(B, H, 0, V), h
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T

    def chunks(x):
        # zero padding is inert: no k/v contribution and decay exp(0) = 1
        return F.pad(x, (0, 0, 0, pad)).reshape(B, H, N, C, x.shape[-1])

    def decays(g):
        """Within-chunk cumulative log-decay b, and P[d, i, j] = exp(b_id - b_jd) for j <= i, else 0."""
        b = chunks(g).cumsum(-2)  # [B, H, N, C, D]
        bt = b.transpose(-1, -2)  # [B, H, N, D, C]
        diff = bt.unsqueeze(-1) - bt.unsqueeze(-2)  # [B, H, N, D, C(i), C(j)], <= 0 for j <= i
        # tril before exp keeps exp away from the (positive) j > i entries; tril after zeroes them.
        # (tril rather than a mask tensor: no plain tensor gets mixed into DTensor inputs.)
        return b, diff.tril().exp().tril()

    q, k, v = chunks(q), chunks(k), chunks(v)
    bk, pair_k = decays(gk)
    # intra-chunk scores A[i, j] = sum_d q_id k_jd exp(bk_id - bk_jd)
    qt, kt = q.transpose(-1, -2), k.transpose(-1, -2)  # [B, H, N, K, C]
    scores = (qt.unsqueeze(-1) * pair_k * kt.unsqueeze(-2)).sum(-3)  # [B, H, N, C, C]
    q_in = q * bk.exp()  # decay from chunk start to token i
    k_out = k * (bk[..., -1:, :] - bk).exp()  # decay from token j to chunk end
    k_last = bk[..., -1, :].exp()  # decay across the whole chunk
    if gv is None:
        o = scores @ v
        v_out, v_in, v_last = v, None, None
    else:
        bv, pair_v = decays(gv)
        o = (scores.unsqueeze(-3) * pair_v * v.transpose(-1, -2).unsqueeze(-2)).sum(-1).transpose(-1, -2)
        v_out = v * (bv[..., -1:, :] - bv).exp()
        v_in, v_last = bv.exp(), bv[..., -1, :].exp()

    # inter-chunk: carry the state over chunks (N small matmuls; autograd keeps each h)
    inter = []
    for n in range(N):
        o_n = q_in[:, :, n] @ h
        inter.append(o_n if v_in is None else o_n * v_in[:, :, n])
        h = h * k_last[:, :, n, :, None]
        if v_last is not None:
            h = h * v_last[:, :, n, None, :]
        h = h + k_out[:, :, n].transpose(-1, -2) @ v_out[:, :, n]
    o = o + torch.stack(inter, dim=2)
    return o.reshape(B, H, N * C, V)[:, :, :T], h


def gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GLA over ``[B, T, H, *]`` inputs; the common implementation of the three fla entry points.

    ``reverse`` runs the recurrence from the last token to the first (fla's
    ``fused_recurrent`` semantics). With ``cu_seqlens`` (``B`` must be 1) each
    packed sequence runs separately with its own initial state.
    """
    spans = None if cu_seqlens is None else sequence_spans(cu_seqlens, cu_seqlens_cpu, q.shape[0])
    if scale is None:
        scale = q.shape[-1] ** -0.5
    out_dtype = q.dtype
    compute = torch.promote_types(q.dtype, torch.float32)

    def heads_first(x):
        return None if x is None else x.transpose(1, 2).to(compute)

    q, k, v, gk, gv = map(heads_first, (q, k, v, gk, gv))
    q = q * scale
    if gk is None:
        gk = torch.zeros_like(k)
    h0 = initial_state
    if h0 is not None:
        h0 = h0.to(compute)
        h0 = h0.transpose(-1, -2) if state_v_first else h0

    def run(span, h_init):
        xs = [None if x is None else x[:, :, span] for x in (q, k, v, gk, gv)]
        if reverse:
            xs = [None if x is None else x.flip(2) for x in xs]
        o, h = _chunked_recurrence(*xs, h_init, chunk_size)
        return (o.flip(2) if reverse else o), h

    if spans is None:
        o, ht = run(slice(None), h0)
    else:
        outs, states = [], []
        for n, (bos, eos) in enumerate(spans):
            o_n, h_n = run(slice(bos, eos), None if h0 is None else h0[n : n + 1])
            outs.append(o_n)
            states.append(h_n)
        o, ht = torch.cat(outs, dim=2), torch.cat(states, dim=0)

    o = o.transpose(1, 2).to(out_dtype)
    if not output_final_state:
        return o, None
    ht = ht.float() if compute == torch.float32 else ht
    return o, (ht.transpose(-1, -2) if state_v_first else ht)


def chunk_gla(
    q, k, v, g, scale=None, initial_state=None, output_final_state=False, state_v_first=False, cu_seqlens=None,
    cu_seqlens_cpu=None,
):
    """Torch version of ``fla.ops.gla.chunk_gla`` (same parameters and returns)."""
    check_varlen(q, initial_state, cu_seqlens)
    return gla(
        q, k, v, gk=g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
    )


def fused_chunk_gla(
    q, k, v, g, scale=None, initial_state=None, output_final_state=False, state_v_first=False, cu_seqlens=None,
    cu_seqlens_cpu=None,
):
    """Torch version of ``fla.ops.gla.fused_chunk_gla``, with ``chunk_gla``'s parameters.

    fla 0.6 deprecated this entry point: its ``fused_chunk_gla(**kwargs)`` raises and points to
    ``chunk_gla`` (so fla's own GLA layers with ``attn_mode="fused_chunk"``, which still call it with
    ``chunk_gla``'s arguments, fail on CUDA). Off CUDA it is ``chunk_gla``, so such a layer still runs.
    """
    return chunk_gla(q, k, v, g, scale, initial_state, output_final_state, state_v_first, cu_seqlens, cu_seqlens_cpu)


def fused_recurrent_gla(
    q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False, reverse=False,
    state_v_first=False, cu_seqlens=None, *, transpose_state_layout=ABSENT,
):
    """Torch version of ``fla.ops.gla.fused_recurrent_gla`` (same parameters; the math computed chunk-wise);
    ``transpose_state_layout`` is fla's deprecated alias of ``state_v_first``."""
    state_v_first = signature.state_v_first(state_v_first, transpose_state_layout)
    check_varlen(q, initial_state, cu_seqlens)
    return gla(
        q, k, v, gk=gk, gv=gv, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        reverse=reverse, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
    )


KERNELS = (
    Kernel("fla.ops.gla.fused_chunk:fused_chunk_gla", fused_chunk_gla, TRITON),
    Kernel("fla.ops.gla.fused_recurrent:fused_recurrent_gla", fused_recurrent_gla, TRITON),
)
"""What titan_ext's models call instead of fla's functions (``kernels.replacements``)."""

SIGNATURES = {
    "fla.ops.gla.fused_recurrent:fused_recurrent_gla":
        "q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False, reverse=False, "
        "state_v_first=False, cu_seqlens=None, **kwargs",
}
"""Parameters (``name=default``) of the functions replaced or called by keyword, as written against them
(``host.checks.check_fla_signatures``)."""
