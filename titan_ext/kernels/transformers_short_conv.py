"""transformers' gated short convolution (LFM2's ``Lfm2ShortConv``, LFM2-MoE's) for training, on fla's convolution
contract.

The layer projects its input to three gates of ``D`` channels each (``in_proj``: all of ``B``, then all of ``C``,
then all of ``x``), convolves ``B * x`` causally per channel (``conv``, a depthwise ``nn.Conv1d`` of ``W`` taps,
no activation) and writes ``C`` times that through ``out_proj``. transformers' own forward convolves ``[B, D, T]``
through its ``causal_conv1d_fn``, which reads no document bounds. Here the same layer calls ``causal_conv1d``
by fla's contract, as fla's ``ShortConvolution`` does, so that:

* packed documents: with ``cu_seq_lens_q`` (the documents' bounds over the batch's ``B * T`` tokens, which
  transformers hands every layer) the rows run as one packed row, and the convolution restarts at every bound;
* each kernel path (``kernels.replacements``) rebinds the name: titan_ext's portable convolution off CUDA,
  fla's on CUDA;
* context parallelism wraps the same name (``context_parallel``: the previous piece's last ``W - 1`` inputs).

Under TP (``mixers.TransformersShortConv.tp_entries``) ``in_proj`` and ``conv`` stay replicated: a rank's
channels are a slice of each gate, a layout no DTensor placement expresses; each rank takes its channels' rows
of each (``tp_local.this_ranks_rows``) and ``out_proj`` sums the ranks' outputs. Training only: a cache is
refused (titan_ext's models run with ``use_cache=False``), as is a 2D padding mask.
"""

from __future__ import annotations

import torch.nn.functional as F
from fla.modules.causal_conv1d.ops import causal_conv1d
from torch.distributed.tensor import DTensor, Partial

from titan_ext.kernels.tp_local import this_ranks_rows

GATES = 3
"""``B``, ``C`` and ``x``: ``in_proj``'s outputs, in that order."""


def lfm2_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """``Lfm2ShortConv.forward`` for training: ``C * conv(B * x)``, each packed document convolved alone."""
    if cache is not None or kwargs.get("past_key_values") is not None:
        raise ValueError(f"titan_ext's {type(self).__name__} trains without a cache (use_cache=False)")
    if attention_mask is not None:  # transformers passes its convolution layers a 2D padding mask only
        raise ValueError(f"titan_ext's {type(self).__name__} takes no padding mask: titan_ext's batches hold none")
    channels = self.conv.in_channels
    b, c, x = _gates(self.in_proj, hidden_states, channels).chunk(GATES, dim=-1)
    mixed, shape, bounds = b * x, b.shape, kwargs.get("cu_seq_lens_q")
    if bounds is not None:  # packed documents: the rows as one row, sequences at cu_seqlens (fla's layout)
        mixed = mixed.reshape(1, -1, mixed.shape[-1])
    bias = None if self.conv.bias is None else this_ranks_rows(self.conv.bias, [channels])
    convolved, _ = causal_conv1d(x=mixed, weight=this_ranks_rows(self.conv.weight, [channels]).squeeze(1), bias=bias,
                                 cu_seqlens=bounds)
    return self.out_proj(c * convolved.reshape(shape))


def _gates(in_proj, hidden_states, channels: int):
    """``in_proj(hidden_states)``: ``[B, T, 3 * D]``; under TP (a replicated weight, the input all-gathered) this
    rank's channels of each gate, ``[B, T, 3 * D / tp]``."""
    if not isinstance(in_proj.weight, DTensor):
        return in_proj(hidden_states)
    sizes = [channels] * GATES
    bias = None if in_proj.bias is None else this_ranks_rows(in_proj.bias, sizes)
    return F.linear(hidden_states.to_local(grad_placements=(Partial(),)), this_ranks_rows(in_proj.weight, sizes), bias)


SIGNATURES = {
    "transformers.models.lfm2.modeling_lfm2:Lfm2ShortConv.forward":
        "self, hidden_states, cache=None, attention_mask=None, **kwargs",
    "transformers.models.lfm2_moe.modeling_lfm2_moe:Lfm2MoeShortConv.forward":
        "self, hidden_states, cache=None, attention_mask=None, **kwargs",
}
"""Parameters (``name=default``) of the functions replaced or called by keyword, as written against them
(``host.checks.check_fla_signatures``)."""
