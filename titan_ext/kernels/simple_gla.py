"""fla's scalar-decay linear attentions off CUDA: simple GLA, linear attention, lightning attention, retention.

One recurrence, one scalar decay per head and token (``DiagonalDecay`` in ``titan_ext.kernels.state_passing``'s
terms: the state's diagonal transition is the same on every key channel, ``exp(g_t)``)::

    S_t = exp(g_t) S_{t-1} + k_t^T v_t        o_t = scale * q_t S_t

with ``g`` a per-token log decay (``[B, T, H]``: simple GLA, Mamba-2's scan), a per-head constant ``g_gamma``
(``[H]``: lightning attention's ``-(8 / H) (1 - layer_idx / num_layers) h``, retention's
``log(1 - 2^(-5 - h))``), both (their sum, as fla's kernels apply both), or neither (linear attention). The
chunked form (``delta_rules.run_delta_rule``'s padding, packed sequences and state layouts around a core of
its own): per chunk, ``O = (QK^T * exp(G_i - G_j) [j <= i]) V + exp(G) * (Q S)``, the state carried from chunk
to chunk; decays are ``exp`` of differences that are at most 0 (within a chunk), plain torch ops
differentiated by autograd. ``reverse`` (fla's ``fused_recurrent``) runs each sequence from its last token.

Every entry point takes fla 0.6.0's parameters, names and defaults (``kernels.signature``), and checks what
fla checks. Inputs ``[B, T, H, K]``/``[B, T, H, V]``; states ``[N, H, K, V]`` (``[N, H, V, K]`` with
``state_v_first``), fp32; outputs in ``v``'s dtype.
"""

from __future__ import annotations

import torch

from titan_ext.kernels import signature
from titan_ext.kernels.delta_rules import run_delta_rule
from titan_ext.kernels.signature import ABSENT, check_varlen
from titan_ext.kernels.table import TRITON, Kernel
from titan_ext.kernels.varlen import token_sequences

CHUNK = 64
"""fla's default chunk for simple GLA."""


def _scalar_decay_rule(q, k, v, g, _beta, state, sequence=None, chunk=CHUNK):
    """``[B, H, T, *]`` (T a multiple of ``chunk``; q scaled), ``g`` ``[B, H, T]``, state ``[B, H, K, V]`` ->
    (o, final state); ``sequence`` (``[T]``, batch 1): each token's packed sequence, as ``delta_rules``'."""
    B, H, T, K = k.shape
    n = T // chunk
    q, k, v = (x.reshape(B, H, n, chunk, -1) for x in (q, k, v))
    G = g.reshape(B, H, n, chunk).cumsum(-1)
    mask = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    carry = torch.ones(n, chunk, dtype=q.dtype, device=q.device)
    if sequence is not None:
        seq = sequence.reshape(n, chunk)
        before = torch.cat([seq[:1, :1], seq[:-1, -1:]])
        mask = mask & (seq.unsqueeze(-1) == seq.unsqueeze(-2))
        carry = (seq == before).to(q.dtype)
    decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~mask, float("-inf")).exp()  # [B, H, n, C, C]
    intra = ((q @ k.transpose(-1, -2)) * decay) @ v
    reads_state = G.exp() * carry  # how much of the incoming state each token sees
    outputs = []
    for i in range(n):
        outputs.append(intra[:, :, i] + reads_state[:, :, i].unsqueeze(-1) * (q[:, :, i] @ state))
        to_last = decay[:, :, i, -1]  # exp(G_last - G_j) for the last token's sequence, else 0
        state = reads_state[:, :, i, -1:].unsqueeze(-1) * state + (to_last.unsqueeze(-1) * k[:, :, i]).transpose(-1, -2) @ v[:, :, i]
    return torch.stack(outputs, dim=2).reshape(B, H, T, -1), state


def _reversed_in_sequences(x: torch.Tensor, cu_seqlens) -> torch.Tensor:
    """``[B, T, ...]`` with each sequence's tokens in reverse order (the whole row, or each packed sequence)."""
    if cu_seqlens is None:
        return x.flip(1)
    sequence, position = token_sequences(cu_seqlens, x.shape[1])
    return x[:, cu_seqlens[sequence + 1] - 1 - position]


def scalar_decay(q, k, v, g, g_gamma, scale, initial_state, output_final_state, reverse, state_v_first, cu_seqlens,
                 chunk_size=CHUNK):
    """The recurrence for fla's inputs (``g``/``g_gamma`` optional, ``scale`` None for ``K ** -0.5``) -> (o, final
    state or None)."""
    B, T, H, K = q.shape
    out_dtype = v.dtype
    wide = torch.promote_types(v.dtype, torch.float32)
    scale = K ** -0.5 if scale is None else scale
    decay = torch.zeros(B, T, H, dtype=wide, device=q.device)
    if g is not None:
        decay = decay + g.to(wide)
    if g_gamma is not None:
        decay = decay + g_gamma.to(wide)
    q, k, v = q.to(wide) * scale, k.to(wide), v.to(wide)
    if reverse:
        q, k, v, decay = (_reversed_in_sequences(x, cu_seqlens) for x in (q, k, v, decay))
    rule = lambda *args: _scalar_decay_rule(*args, chunk=chunk_size)  # noqa: E731
    o, ht = run_delta_rule(rule, chunk_size, q, k, v, decay, decay, initial_state, output_final_state, cu_seqlens,
                           state_v_first, out_dtype)
    if reverse:
        o = _reversed_in_sequences(o, cu_seqlens)
    return o, (ht.float() if ht is not None and wide == torch.float32 else ht)


def _check_chunk_size(chunk_size) -> int:
    if chunk_size is not None and chunk_size != 2 ** (chunk_size.bit_length() - 1):
        raise ValueError(f"`chunk_size` must be a power of 2, got {chunk_size}.")
    return CHUNK if chunk_size is None else chunk_size


# --- simple GLA (fla.ops.simple_gla) -------------------------------------------------------------------


def chunk_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    *,
    head_first=ABSENT,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``chunk_simple_gla`` (``DiagonalDecay``, a scalar per head): ``chunk_size`` a power of 2, as fla
    checks it (default 64), is the chunk the core runs; ``cu_seqlens_cpu`` is a copy of ``cu_seqlens``."""
    signature.no_head_first(head_first)
    chunk = _check_chunk_size(chunk_size)
    check_varlen(q, initial_state, cu_seqlens)
    return scalar_decay(q, k, v, g, g_gamma, scale, initial_state, output_final_state, False, state_v_first,
                        cu_seqlens, chunk)


def fused_chunk_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``fused_chunk_simple_gla``: the same math (``DiagonalDecay``)."""
    check_varlen(q, initial_state, cu_seqlens)
    return scalar_decay(q, k, v, g, g_gamma, scale, initial_state, output_final_state, False, False, cu_seqlens)


def fused_recurrent_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    *,
    transpose_state_layout=ABSENT,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``fused_recurrent_simple_gla`` (``DiagonalDecay``), computed chunk-wise; ``reverse`` runs each
    sequence from its last token."""
    state_v_first = signature.state_v_first(state_v_first, transpose_state_layout)
    check_varlen(q, initial_state, cu_seqlens)
    return scalar_decay(q, k, v, g, g_gamma, scale, initial_state, output_final_state, reverse, state_v_first,
                        cu_seqlens)


def parallel_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    output_attentions: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``parallel_simple_gla``: ``o`` (the same math, ``DiagonalDecay``) and, with ``output_attentions``,
    the ``[B, H, T, T]`` decayed scores ``scale * q_i k_j exp(G_i - G_j)`` for ``j <= i``."""
    check_varlen(q, None, cu_seqlens)
    if output_attentions and cu_seqlens is not None:
        raise ValueError("output_attentions=True is not supported with variable-length sequences")
    o, _ = scalar_decay(q, k, v, g, None, scale, None, False, False, False, cu_seqlens)
    if not output_attentions:
        return o, None
    wide = torch.promote_types(q.dtype, torch.float32)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q.to(wide).transpose(1, 2) @ k.to(wide).transpose(1, 2).transpose(-1, -2) * scale
    G = (torch.zeros(q.shape[:3], dtype=wide, device=q.device) if g is None else g.to(wide)).transpose(1, 2).cumsum(-1)
    mask = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool, device=q.device).tril()
    decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~mask, float("-inf")).exp()
    return o, (scores * decay).to(q.dtype)


# --- linear attention (fla.ops.linear_attn): no decay, optionally normalised by the running key sum ------------


def _normalize(o, q, k, scale, z_init, reverse, cu_seqlens):
    """fla's ``normalize_with_z_state``: ``o_t / (scale * q_t . z_t + 1e-10)`` with ``z_t`` the running sum of
    keys (from ``z_init``, ``[N, 1, H, K]``; backwards with ``reverse``), each packed sequence its own; returns
    ``(o, z)``, ``z`` the sum at each sequence's end (``[N, 1, H, K]``; an empty sequence keeps ``z_init``)."""
    total = k.cumsum(1)
    before = total - k  # the sum of the keys before each token
    if cu_seqlens is None:
        k_cum = total[:, -1:] - before if reverse else total
        z_each = None if z_init is None else z_init
    else:
        sequence, _ = token_sequences(cu_seqlens, k.shape[1])
        last = total[:, (cu_seqlens[sequence + 1] - 1).clamp_min(0)]
        first = before[:, cu_seqlens[sequence]]
        k_cum = last - before if reverse else total - first
        z_each = None if z_init is None else z_init.squeeze(1)[sequence].unsqueeze(0)
    if z_each is not None:
        k_cum = k_cum + z_each
    o = o / ((q * scale * k_cum).sum(-1, keepdim=True) + 1e-10)
    if cu_seqlens is None:
        return o, (k_cum[:, :1] if reverse else k_cum[:, -1:])
    ends = cu_seqlens[:-1] if reverse else cu_seqlens[1:] - 1
    z = k_cum[0, ends.clamp(0, max(k.shape[1] - 1, 0))].unsqueeze(1)
    nonempty = (cu_seqlens[1:] > cu_seqlens[:-1])[:, None, None, None]
    return o, torch.where(nonempty, z, z_init if z_init is not None else torch.zeros_like(z))


def _linear_attn(q, k, v, scale, initial_state, output_final_state, reverse, normalize, cu_seqlens, scale_of):
    if normalize and isinstance(initial_state, tuple):
        kv_init, z_init = initial_state
    else:
        kv_init, z_init = initial_state, None
    check_varlen(q, kv_init, cu_seqlens)
    if scale is None:
        scale = scale_of.shape[-1] ** -0.5
    o, final_state = scalar_decay(q, k, v, None, None, scale, kv_init, output_final_state, reverse, False,
                                  cu_seqlens)
    if normalize:
        o, z_state = _normalize(o, q, k, scale, z_init, reverse, cu_seqlens)
        return o, (final_state, z_state)
    return o, final_state


def chunk_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | tuple | None = None,
    output_final_state: bool = False,
    normalize: bool = True,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | tuple]:
    """fla's ``chunk_linear_attn`` (no decay: ``DiagonalDecay`` with a zero log decay); with ``normalize`` the
    state is ``(kv, z)``, ``z`` the running key sum (``[N, 1, H, K]``)."""
    return _linear_attn(q, k, v, scale, initial_state, output_final_state, False, normalize, cu_seqlens, k)


def fused_chunk_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | tuple | None = None,
    output_final_state: bool = False,
    normalize: bool = True,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | tuple]:
    """fla's ``fused_chunk_linear_attn``: the same math (``DiagonalDecay``, no decay)."""
    return _linear_attn(q, k, v, scale, initial_state, output_final_state, False, normalize, cu_seqlens, q)


def fused_recurrent_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | tuple | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    normalize: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | tuple]:
    """fla's ``fused_recurrent_linear_attn`` (``DiagonalDecay``, no decay), computed chunk-wise."""
    return _linear_attn(q, k, v, scale, initial_state, output_final_state, reverse, normalize, cu_seqlens, q)


# --- lightning attention (fla.ops.lightning_attn): a fixed decay per head and layer ---------------------------


def _lightning_gamma(q, layer_idx, num_layers):
    H = q.shape[2]
    return -(8 / H * (1 - layer_idx / num_layers)) * torch.arange(H, dtype=torch.float, device=q.device)


def chunk_lightning_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    num_layers: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    *,
    head_first=ABSENT,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``chunk_lightning_attn``: simple GLA with ``g_gamma = -(8 / H) (1 - layer_idx / num_layers) h``
    (``DiagonalDecay``)."""
    signature.no_head_first(head_first)
    check_varlen(q, initial_state, cu_seqlens)
    return chunk_simple_gla(q, k, v, g_gamma=_lightning_gamma(q, layer_idx, num_layers), scale=scale,
                            initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                            chunk_size=chunk_size)


def fused_recurrent_lightning_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    num_layers: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``fused_recurrent_lightning_attn`` (``DiagonalDecay``)."""
    check_varlen(q, initial_state, cu_seqlens)
    return fused_recurrent_simple_gla(q, k, v, g_gamma=_lightning_gamma(q, layer_idx, num_layers), scale=scale,
                                      initial_state=initial_state, output_final_state=output_final_state,
                                      reverse=reverse, cu_seqlens=cu_seqlens)


# --- retention (fla.ops.retention): RetNet's fixed decay per head --------------------------------------------


def _retention_gamma(q):
    return (1 - 2.0 ** (-5.0 - torch.arange(q.shape[2], dtype=torch.float, device=q.device))).log()


def chunk_retention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    *,
    head_first=ABSENT,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``chunk_retention``: simple GLA with ``g_gamma = log(1 - 2^(-5 - h))`` (``DiagonalDecay``)."""
    signature.no_head_first(head_first)
    check_varlen(q, initial_state, cu_seqlens)
    return chunk_simple_gla(q, k, v, g_gamma=_retention_gamma(q), scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size)


def fused_chunk_retention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``fused_chunk_retention`` (``DiagonalDecay``)."""
    check_varlen(q, initial_state, cu_seqlens)
    return fused_chunk_simple_gla(q, k, v, g_gamma=_retention_gamma(q), scale=scale, initial_state=initial_state,
                                  output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def fused_recurrent_retention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    *,
    transpose_state_layout=ABSENT,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``fused_recurrent_retention`` (``DiagonalDecay``)."""
    state_v_first = signature.state_v_first(state_v_first, transpose_state_layout)
    check_varlen(q, initial_state, cu_seqlens)
    return fused_recurrent_simple_gla(q, k, v, g_gamma=_retention_gamma(q), scale=scale, initial_state=initial_state,
                                      output_final_state=output_final_state, reverse=reverse,
                                      state_v_first=state_v_first, cu_seqlens=cu_seqlens)


def parallel_retention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    output_attentions: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``parallel_retention``: ``parallel_simple_gla`` with retention's decay as ``g`` (``DiagonalDecay``)."""
    check_varlen(q, None, cu_seqlens)
    g = _retention_gamma(q)[None, None, :].expand(q.shape[0], q.shape[1], q.shape[2])
    return parallel_simple_gla(q, k, v, g=g, scale=scale, output_attentions=output_attentions, cu_seqlens=cu_seqlens)


__all__ = ["chunk_simple_gla", "fused_chunk_simple_gla", "fused_recurrent_simple_gla", "parallel_simple_gla",
           "chunk_linear_attn", "fused_chunk_linear_attn", "fused_recurrent_linear_attn", "chunk_lightning_attn",
           "fused_recurrent_lightning_attn", "chunk_retention", "fused_chunk_retention", "fused_recurrent_retention",
           "parallel_retention"]


KERNELS = (
    Kernel(
        "fla.ops.simple_gla.chunk:chunk_simple_gla", chunk_simple_gla,
        "fla's SimpleGatedLinearAttention and YOCO layers (a scalar decay per head: Mamba-2's scan): " + TRITON,
    ),
    Kernel(
        "fla.ops.simple_gla.fused_chunk:fused_chunk_simple_gla", fused_chunk_simple_gla,
        "fla's fused_chunk linear attention and retention: " + TRITON,
    ),
    Kernel(
        "fla.ops.simple_gla.fused_recurrent:fused_recurrent_simple_gla", fused_recurrent_simple_gla,
        "fla's SimpleGatedLinearAttention and YOCO layers (decoding): " + TRITON,
    ),
    Kernel(
        "fla.ops.simple_gla.parallel:parallel_simple_gla", parallel_simple_gla,
        "fla's parallel retention: " + TRITON,
    ),
    Kernel(
        "fla.ops.linear_attn.chunk:chunk_linear_attn", chunk_linear_attn,
        "fla's LinearAttention, Based and ReBased layers: " + TRITON,
    ),
    Kernel(
        "fla.ops.linear_attn.fused_chunk:fused_chunk_linear_attn", fused_chunk_linear_attn,
        "fla's LinearAttention, Based and ReBased layers: " + TRITON,
    ),
    Kernel(
        "fla.ops.linear_attn.fused_recurrent:fused_recurrent_linear_attn", fused_recurrent_linear_attn,
        "fla's LinearAttention layer (decoding): " + TRITON,
    ),
    Kernel(
        "fla.ops.lightning_attn.chunk:chunk_lightning_attn", chunk_lightning_attn,
        "lightning attention (simple GLA with a fixed decay per head and layer): " + TRITON,
    ),
    Kernel(
        "fla.ops.lightning_attn.fused_recurrent:fused_recurrent_lightning_attn", fused_recurrent_lightning_attn,
        "lightning attention (decoding): " + TRITON,
    ),
    Kernel(
        "fla.ops.retention.chunk:chunk_retention", chunk_retention,
        "fla's MultiScaleRetention layer (RetNet): " + TRITON,
    ),
    Kernel(
        "fla.ops.retention.fused_chunk:fused_chunk_retention", fused_chunk_retention,
        "fla's MultiScaleRetention layer (RetNet): " + TRITON,
    ),
    Kernel(
        "fla.ops.retention.fused_recurrent:fused_recurrent_retention", fused_recurrent_retention,
        "fla's MultiScaleRetention layer (RetNet, decoding): " + TRITON,
    ),
    Kernel(
        "fla.ops.retention.parallel:parallel_retention", parallel_retention,
        "fla's MultiScaleRetention layer (RetNet): " + TRITON,
    ),
)
"""What titan_ext's models call instead of fla's functions (``kernels.replacements``)."""

SIGNATURES = {
    "fla.ops.simple_gla.chunk:chunk_simple_gla":
        "q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False, "
        "state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs",
    "fla.ops.simple_gla.fused_chunk:fused_chunk_simple_gla":
        "q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False, "
        "cu_seqlens=None",
    "fla.ops.simple_gla.fused_recurrent:fused_recurrent_simple_gla":
        "q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False, "
        "reverse=False, state_v_first=False, cu_seqlens=None, **kwargs",
    "fla.ops.simple_gla.parallel:parallel_simple_gla":
        "q, k, v, g=None, scale=None, output_attentions=False, cu_seqlens=None, cu_seqlens_cpu=None",
    "fla.ops.linear_attn.chunk:chunk_linear_attn":
        "q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True, cu_seqlens=None",
    "fla.ops.linear_attn.fused_chunk:fused_chunk_linear_attn":
        "q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True, cu_seqlens=None",
    "fla.ops.linear_attn.fused_recurrent:fused_recurrent_linear_attn":
        "q, k, v, scale=None, initial_state=None, output_final_state=False, reverse=False, normalize=False, "
        "cu_seqlens=None",
    "fla.ops.lightning_attn.chunk:chunk_lightning_attn":
        "q, k, v, layer_idx, num_layers, scale=None, initial_state=None, output_final_state=False, "
        "cu_seqlens=None, **kwargs",
    "fla.ops.lightning_attn.fused_recurrent:fused_recurrent_lightning_attn":
        "q, k, v, layer_idx, num_layers, scale=None, initial_state=None, output_final_state=False, "
        "reverse=False, cu_seqlens=None",
    "fla.ops.retention.chunk:chunk_retention":
        "q, k, v, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, **kwargs",
    "fla.ops.retention.fused_chunk:fused_chunk_retention":
        "q, k, v, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None",
    "fla.ops.retention.fused_recurrent:fused_recurrent_retention":
        "q, k, v, scale=None, initial_state=None, output_final_state=False, reverse=False, "
        "state_v_first=False, cu_seqlens=None, **kwargs",
    "fla.ops.retention.parallel:parallel_retention": "q, k, v, scale=None, output_attentions=False, cu_seqlens=None",
}
"""Parameters (``name=default``) of the functions replaced or called by keyword, as written against them
(``host.checks.check_fla_signatures``)."""
