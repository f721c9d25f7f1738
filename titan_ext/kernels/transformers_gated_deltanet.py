"""transformers' Gated DeltaNet layers (Qwen3.5's and Qwen3-Next's ``linear_attn``) for training, on fla's kernel
contracts.

transformers' own forward convolves ``[B, D, T]`` through its ``causal_conv1d_fn`` (no document resets)
and calls its ``torch_chunk_gated_delta_rule`` wrapper with the batch as it is. Here the same layer (its
own parameters, projections and gated norm) calls ``causal_conv1d`` and ``chunk_gated_delta_rule`` by
fla's contracts, as fla's ``GatedDeltaNet`` does, so that what titan_ext does for fla's Gated DeltaNet
holds here too:

* packed documents: with ``cu_seq_lens_q`` (the documents' bounds over the batch's ``B * T`` tokens, which
  transformers hands every layer) the rows run as one packed row, and the state and the convolution
  restart at every bound;
* each kernel path (``kernels.replacements``) rebinds both names: titan_ext's portable kernels off
  CUDA, fla's on CUDA;
* context parallelism wraps the same two names (``context_parallel``: state passing, the convolution's
  halo).

Widths are read from the tensors, so the layer runs on whatever share of its heads it holds: under TP
(``mixers.TransformersGatedDeltaNet.tp_entries``) the weights holding all queries, then all keys, then all
values (Qwen3.5's ``in_proj_qkv``, the ``conv1d``) are replicated, and each rank takes its heads' rows of
each (``tp_local.this_ranks_rows``). Training only: a cache is refused (titan_ext's models run with
``use_cache=False``), as is a 2D padding mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fla.modules.causal_conv1d.ops import causal_conv1d
from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule
from torch.distributed.tensor import DTensor, Partial

from titan_ext.kernels.gated_delta import _softplus
from titan_ext.kernels.tp_local import local, this_ranks_rows


def qwen3_5_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """``Qwen3_5GatedDeltaNet.forward``: q, k and v from one projection (``in_proj_qkv``: all queries, all keys,
    all values), the output gate, beta and the decay's input from their own."""
    _check_training(self, cache, attention_mask, kwargs)
    if isinstance(self.in_proj_qkv.weight, DTensor):  # TP: this rank's heads' rows of the replicated weight
        rows = this_ranks_rows(self.in_proj_qkv.weight, [self.key_dim, self.key_dim, self.value_dim])
        mixed = F.linear(hidden_states.to_local(grad_placements=(Partial(),)), rows)
    else:
        mixed = self.in_proj_qkv(hidden_states)
    z, b, a = self.in_proj_z(hidden_states), self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
    return _mix(self, mixed, z, b, a, kwargs.get("cu_seq_lens_q"), causal_conv1d, chunk_gated_delta_rule)


def qwen3_next_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """``Qwen3NextGatedDeltaNet.forward``: its projections are grouped by key head (``in_proj_qkvz``: each key
    head's query, key, values and output gates; ``in_proj_ba``: its value heads' beta and decay input)."""
    _check_training(self, cache, attention_mask, kwargs)
    group = self.num_v_heads // self.num_k_heads  # value heads per key head
    qkvz = self.in_proj_qkvz(hidden_states).unflatten(-1, (-1, 2 * self.head_k_dim + 2 * group * self.head_v_dim))
    q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, group * self.head_v_dim, group * self.head_v_dim], -1)
    b, a = self.in_proj_ba(hidden_states).unflatten(-1, (-1, 2 * group)).split([group, group], -1)
    mixed = torch.cat([q.flatten(-2), k.flatten(-2), v.flatten(-2)], dim=-1)  # all queries, all keys, all values
    return _mix(self, mixed, z.flatten(-2), b.flatten(-2), a.flatten(-2), kwargs.get("cu_seq_lens_q"), causal_conv1d,
                chunk_gated_delta_rule)


def _check_training(self, cache, attention_mask, kwargs) -> None:
    """``kwargs``: transformers 5.17 passes the cache as ``cache_params`` (5.24 as ``cache``)."""
    if cache is not None or kwargs.pop("cache_params", None) is not None:
        raise ValueError(f"titan_ext's {type(self).__name__} trains without a cache (use_cache=False)")
    if attention_mask is not None:  # transformers passes linear attention a 2D padding mask only
        raise ValueError(f"titan_ext's {type(self).__name__} takes no padding mask: titan_ext's batches hold no padding")


def _mix(self, mixed, z, b, a, cu_seqlens, conv, rule):
    """The layer after its projections: ``mixed`` (``[B, T, 2 * keys + values]``, channels ordered as the
    conv weight's), the output gate ``z`` (``[B, T, values]``), beta's and the decay's inputs (``[B, T, HV]``).
    The kernels (``conv``, ``rule``) come from the forward, whose globals the bindings rebind."""
    shape = mixed.shape[:2]
    if cu_seqlens is not None:  # packed documents: the rows as one row, sequences at cu_seqlens (fla's layout)
        mixed, z, b, a = (x.reshape(1, -1, x.shape[-1]) for x in (mixed, z, b, a))
    sizes = [self.key_dim, self.key_dim, self.value_dim]
    bias = None if self.conv1d.bias is None else this_ranks_rows(self.conv1d.bias, sizes)
    mixed, _ = conv(x=mixed, weight=this_ranks_rows(self.conv1d.weight, sizes).squeeze(1), bias=bias,
                     activation=self.activation, cu_seqlens=cu_seqlens)
    share = self.conv_dim // mixed.shape[-1]  # 1, or the tensor-parallel degree: this rank's share of the heads
    keys, values = self.key_dim // share, self.value_dim // share
    q, k, v = mixed.split([keys, keys, values], dim=-1)
    q, k = q.unflatten(-1, (-1, self.head_k_dim)), k.unflatten(-1, (-1, self.head_k_dim))
    v = v.unflatten(-1, (-1, self.head_v_dim))
    wide = torch.promote_types(a.dtype, torch.float32)  # the decay in fp32 at least, as transformers has it
    g = -local(self.A_log).to(wide).exp() * _softplus(a.to(wide) + local(self.dt_bias))
    o, _ = rule(q=q, k=k, v=v, g=g, beta=b.sigmoid(), use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
    o = self.norm(o, z.unflatten(-1, (-1, self.head_v_dim)))  # per value head: its own rows, one shared weight
    return self.out_proj(o.reshape(*shape, -1))


SIGNATURES = {
    "transformers.models.qwen3_5.modeling_qwen3_5:Qwen3_5GatedDeltaNet.forward": (
        "self, hidden_states, cache=None, attention_mask=None, **kwargs",
        "self, hidden_states, cache_params=None, attention_mask=None, **kwargs",
    ),
    "transformers.models.qwen3_next.modeling_qwen3_next:Qwen3NextGatedDeltaNet.forward": (
        "self, hidden_states, cache=None, attention_mask=None, **kwargs",
        "self, hidden_states, cache_params=None, attention_mask=None, **kwargs",
    ),
}
"""Parameters (``name=default``) of the functions replaced or called by keyword, as written against them
(``host.checks.check_fla_signatures``)."""
