"""transformers' lightning attention (MiniMax's ``MiniMaxLightningAttention``) for training, on fla's simple GLA
contract.

Per head ``h`` a linear attention with a fixed decay rate ``s_h`` (the module's ``slope_rate`` buffer), no
softmax and no query scale::

    S_t = exp(-s_h) S_{t-1} + k_t^T v_t        o_t = q_t S_t

transformers' own forward computes it block by block in torch (``block_size`` tokens, decays from its
``query_decay``/``key_decay``/``diagonal_decay`` buffers), over the whole batch as it is. Here the same
recurrence is fla's ``chunk_simple_gla`` with a per-token log decay ``g = -s_h`` and ``scale=1``, so that:

* packed documents: with ``cu_seq_lens_q`` (the documents' bounds over the batch's ``B * T`` tokens) the rows
  run as one packed row, and the state restarts at every bound;
* each kernel path (``kernels.replacements``) rebinds the name: titan_ext's portable simple GLA off CUDA,
  fla's on CUDA;
* context parallelism passes the state across ranks (``state_passing.DiagonalDecay``, a scalar decay per head).

Under TP (``mixers.TransformersLightningAttention.tp_entries``) the layer runs on its rank's heads: q, k and v
come per head from ``qkv_proj`` (each head's three side by side, so a contiguous split keeps heads whole), the
decay rates are this rank's share (``tp_share``, recorded by ``model_plans.styles.HeadShare``), and the norm
over all heads' outputs sums their squares over the ranks. Training only: a cache is refused.
"""

from __future__ import annotations

import torch
from fla.ops.simple_gla.chunk import chunk_simple_gla

QKV = 3
"""q, k and v: each head's ``qkv_proj`` outputs, side by side."""


def minimax_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
    """``MiniMaxLightningAttention.forward`` for training: ``out_proj(sigmoid(output_gate(x)) * norm(o))``."""
    if cache is not None or kwargs.get("past_key_values") is not None:
        raise ValueError(f"titan_ext's {type(self).__name__} trains without a cache (use_cache=False)")
    if attention_mask is not None:  # transformers passes its linear attention a 2D padding mask only
        raise ValueError(f"titan_ext's {type(self).__name__} takes no padding mask: titan_ext's batches hold none")
    qkv = self.act_fn(self.qkv_proj(hidden_states))
    q, k, v = qkv.unflatten(-1, (-1, QKV * self.head_dim)).chunk(QKV, dim=-1)
    shape, bounds = q.shape, kwargs.get("cu_seq_lens_q")
    g = -this_ranks_heads(self.slope_rate.flatten(), self).to(torch.promote_types(q.dtype, torch.float32))
    g = g.expand(shape[:3])
    if bounds is not None:  # packed documents: the rows as one row, sequences at cu_seqlens (fla's layout)
        q, k, v, g = (x.reshape(1, -1, *x.shape[2:]) for x in (q, k, v, g))
    o, _ = chunk_simple_gla(q=q, k=k, v=v, g=g, scale=1.0, cu_seqlens=bounds)
    o = self.norm(o.reshape(*shape[:2], -1))
    return self.out_proj(torch.sigmoid(self.output_gate(hidden_states)) * o), None


def this_ranks_heads(per_head: torch.Tensor, module) -> torch.Tensor:
    """``per_head`` (``[H]``) for the heads this rank holds under TP (``module.tp_share``: (rank, ranks)), else
    all of it."""
    rank, ranks = getattr(module, "tp_share", (0, 1))
    return per_head.chunk(ranks)[rank]


SIGNATURES = {
    "transformers.models.minimax.modeling_minimax:MiniMaxLightningAttention.forward":
        "self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs",
}
"""Parameters (``name=default``) of the functions replaced or called by keyword, as written against them
(``host.checks.check_fla_signatures``)."""
