"""transformers' Mamba2 mixers (Mamba2, Bamba, Granite 4.0 hybrid, Nemotron-H, Zamba2) for training, on fla's
kernel contracts.

transformers' forward convolves ``[B, D, T]`` through its ``causal_conv1d_fn`` and scans with its
``mamba2_chunk_scan`` (mamba_ssm's ``mamba_chunk_scan_combined``) over the batch as it is. Mamba-2's scan is a
scalar-decay linear recurrence: per head, with state ``h`` (``[N, P]``), ``h_t = exp(dt_t A) h_{t-1} + B_t (dt_t
x_t)^T`` and ``y_t = C_t^T h_t + D x_t``, which is fla's simple GLA with ``q = C``, ``k = B``, ``v = dt x``,
``g = dt A`` and scale 1. Here the same layer (its own parameters) calls fla's ``causal_conv1d`` and
``chunk_simple_gla``, so that what titan_ext does for fla's recurrences holds here too:

* packed documents: with ``cu_seq_lens_q`` (the documents' bounds over the batch's ``B * T`` tokens) the rows
  run as one packed row, and the scan and the convolution restart at every bound;
* each kernel path (``kernels.replacements``) rebinds both names: titan_ext's portable kernels off CUDA,
  fla's on CUDA;
* context parallelism wraps the same two names (``context_parallel``: state passing, ``DiagonalDecay``; the
  convolution's halo).

Under TP (``mixers.TransformersMamba2.tp_entries``) each rank runs its share of the heads. ``in_proj`` packs
``z`` (all heads), ``x`` (all heads), ``B`` and ``C`` (all groups) and ``dt`` (all heads), the ``conv1d`` ``x``,
``B`` and ``C``: their weights stay replicated over the TP ranks and each rank takes its heads' and groups'
rows (``_local_rows``). With fewer groups than ranks, the ranks sharing a group each take all of it, and its
gated norm sums the group's squares over the TP ranks. Training only: a cache is refused (titan_ext's models
run with ``use_cache=False``), as is a 2D padding mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from fla.modules.causal_conv1d.ops import causal_conv1d
from fla.ops.simple_gla.chunk import chunk_simple_gla
from torch.distributed.tensor import DTensor, Partial

from titan_ext import compat
from titan_ext.kernels.tp_local import SumGradients, local
from titan_ext.kernels.transformers_gated_deltanet import _check_training


def mamba2_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """``Mamba2Mixer.forward`` (and its copies in the hybrids): ``in_proj``, the convolution over ``x``, ``B`` and
    ``C``, the scan, the gated norm (gate first) and ``out_proj``."""
    _check_training(self, cache, attention_mask, kwargs)
    norm = GatedNorm(self.norm.variance_epsilon, before_gate=False)
    return mamba2_mix(self, hidden_states, kwargs.get("cu_seq_lens_q"), self.time_step_limit, norm, causal_conv1d,
                      chunk_simple_gla)


@dataclass(frozen=True)
class GatedNorm:
    """How a Mamba2 mixer's gated norm reads its module: its epsilon, and whether it normalises before the gate
    (fla's ``RMSNormGated(norm_before_gate=True)``) or after (transformers' ``MambaRMSNormGated``)."""

    eps: float
    before_gate: bool


def mamba2_mix(self, hidden_states, cu_seqlens, limit, norm: GatedNorm, conv, rule):
    """A Mamba2 mixer's output from its parameters (``in_proj``, ``conv1d``, ``A_log``, ``D``, ``dt_bias``, the gated
    norm's weight, ``out_proj``); ``dt`` clamped to ``limit``. The kernels (``conv``, ``rule``) come from the
    forward, whose globals the bindings rebind."""
    share = Share.of(self)
    projected = F.linear(_local_input(hidden_states), *_linear_rows(self.in_proj, share.projection_rows()))
    width = share.heads * self.head_dim
    z, xbc, dt = projected.split([width, projected.shape[-1] - width - share.heads, share.heads], dim=-1)
    shape = z.shape
    if cu_seqlens is not None:  # packed documents: the rows as one row, sequences at cu_seqlens (fla's layout)
        xbc, dt = xbc.reshape(1, -1, xbc.shape[-1]), dt.reshape(1, -1, dt.shape[-1])
    weight, bias = _linear_rows(self.conv1d, share.conv_rows())
    xbc, _ = conv(x=xbc, weight=weight.squeeze(1), bias=bias, activation=self.activation, cu_seqlens=cu_seqlens)
    x, b, c = xbc.split([width, share.groups * self.ssm_state_size, share.groups * self.ssm_state_size], dim=-1)
    y = _scan(self, x, b, c, dt, share, cu_seqlens, limit, rule)
    y = _gated_norm(self.norm, y.reshape(shape), z, share, norm)
    return self.out_proj(y.to(hidden_states.dtype))


@dataclass(frozen=True)
class Share:
    """This rank's share of a Mamba2 mixer: ``heads`` heads from ``first_head``, ``groups`` groups of B and C from
    ``first_group`` (1 group, shared with other ranks, when there are fewer groups than ranks); the whole mixer
    without TP."""

    num_heads: int
    n_groups: int
    head_dim: int
    state: int
    first_head: int
    heads: int
    first_group: int
    groups: int

    @classmethod
    def of(cls, mixer) -> Share:
        """The share of the rank running ``mixer`` (the TP mesh its replicated ``in_proj`` lives on)."""
        weight = mixer.in_proj.weight
        if not isinstance(weight, DTensor):
            return cls.on(mixer, 1, 0)
        return cls.on(mixer, weight.device_mesh.size(), weight.device_mesh.get_local_rank())

    @classmethod
    def on(cls, mixer, ranks: int, rank: int) -> Share:
        H, G = mixer.num_heads, mixer.n_groups
        heads = H // ranks
        first_head = rank * heads
        groups = max(G // ranks, 1)
        first_group = rank * groups if G >= ranks else first_head // (H // G)
        return cls(H, G, mixer.head_dim, mixer.ssm_state_size, first_head, heads, first_group, groups)

    @property
    def whole_groups(self) -> bool:
        """Whether each of this rank's groups is whole here (its gated norm then needs no other rank)."""
        return self.heads * self.n_groups >= self.num_heads

    def conv_rows(self) -> list[tuple[int, int]]:
        """(start, length) of this rank's rows in the convolution's ``x``, ``B``, ``C`` channels."""
        P, N, width, groups = self.head_dim, self.state, self.num_heads * self.head_dim, self.n_groups * self.state
        return [(self.first_head * P, self.heads * P), (width + self.first_group * N, self.groups * N),
                (width + groups + self.first_group * N, self.groups * N)]

    def projection_rows(self) -> list[tuple[int, int]]:
        """(start, length) of this rank's rows in ``in_proj``'s ``z``, ``x``, ``B``, ``C``, ``dt`` outputs."""
        P, width = self.head_dim, self.num_heads * self.head_dim
        conv = [(width + start, length) for start, length in self.conv_rows()]
        dt = 2 * width + 2 * self.n_groups * self.state + self.first_head
        return [(self.first_head * P, self.heads * P), *conv, (dt, self.heads)]


def _local_input(hidden_states):
    """The layer's input as this rank's plain tensor (under TP a replicated DTensor, whose gradient each rank's
    heads give a part of)."""
    if isinstance(hidden_states, DTensor):
        return hidden_states.to_local(grad_placements=(Partial(),))
    return hidden_states


def _linear_rows(module, rows: list[tuple[int, int]]):
    """(weight, bias) of ``module`` restricted to ``rows`` under TP (its weights replicated: gradients summed over
    the TP ranks, ``SumGradients``); the module's own without TP."""
    weight, bias = module.weight, module.bias
    if not isinstance(weight, DTensor):
        return weight, bias
    group = weight.device_mesh.get_group()
    index = torch.cat([torch.arange(start, start + length, device=weight.device) for start, length in rows])
    return tuple(None if p is None else SumGradients.apply(p.to_local(), group).index_select(0, index)
                 for p in (weight, bias))


def _scan(self, x, b, c, dt, share: Share, cu_seqlens, limit, rule):
    """``mamba2_chunk_scan``'s output (``[1 or B, T, heads, P]``, fp32) through ``rule`` (fla's
    ``chunk_simple_gla`` contract): the discretisation in fp32, as transformers has it."""
    wide = torch.promote_types(x.dtype, torch.float32)
    dt = F.softplus(dt + local(self.dt_bias).to(dt.dtype))
    low, high = limit
    dt = torch.clamp(dt, min=low, max=high).to(wide)
    x = x.unflatten(-1, (share.heads, self.head_dim)).to(wide)
    per_group = share.heads // share.groups
    b, c = (t.unflatten(-1, (share.groups, self.ssm_state_size)).to(wide).repeat_interleave(per_group, dim=2)
            for t in (b, c))
    g = -torch.exp(local(self.A_log).to(wide)) * dt
    y, _ = rule(q=c, k=b, v=x * dt[..., None], g=g, scale=1.0, cu_seqlens=cu_seqlens)
    skip = local(self.D).to(wide)
    skip = skip.view(share.heads, -1) if skip.numel() > share.heads else skip[:, None]  # per head, or per channel
    return y + skip * x


def _gated_norm(module, y, z, share: Share, norm: GatedNorm):
    """The gated norm of ``y`` (fp32) by ``z`` on this rank's channels: ``y * silu(z)`` (or ``y``, where the norm
    comes before the gate), divided by the root mean square over its group, times the norm's weight (then times
    ``silu(z)``, where the norm comes first); a group spread over several ranks sums its squares over the TP ranks."""
    dtype = y.dtype
    gate = F.silu(z.float())
    y = y.float() if norm.before_gate else y.float() * gate
    group_size = module.group_size
    if share.whole_groups:
        grouped = y.unflatten(-1, (-1, group_size))
        variance = grouped.pow(2).mean(-1, keepdim=True)
    else:  # this rank holds part of one group, as do the next ranks up to the group's end: their parts summed
        grouped = y.unsqueeze(-2)
        parts = compat.all_gather_autograd(y.pow(2).sum(-1)[None], module.weight.device_mesh.get_group())
        sharing = share.num_heads // share.n_groups // share.heads  # ranks per group
        first = share.first_group * sharing
        variance = parts[first : first + sharing].sum(0)[..., None, None] / group_size
    y = (grouped * torch.rsqrt(variance + norm.eps)).flatten(-2)
    y = local(module.weight) * y.to(dtype)
    return y * gate.to(dtype) if norm.before_gate else y
