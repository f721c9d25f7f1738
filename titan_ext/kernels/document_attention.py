"""Causal softmax attention within each packed document, from ``cu_seqlens``: no ``B x T x T`` mask.

A transformers attention function (``ALL_ATTENTION_FUNCTIONS``' contract: ``[B, H, T, D]`` in,
``[B, T, H, D]`` out) for models whose documents are packed into rows (``titan_ext.data.documents``): the rows'
tokens are taken as one packed sequence and each document attends to itself, causally. On CUDA, torch's
variable-length kernel for bf16/fp16 (``torch.nn.attention.varlen``, where this torch has it with
``window_size`` and ``enable_gqa``: torch 2.13; untested on a GPU here) unless the model's attention has sinks
or logit softcapping, which it cannot apply; elsewhere one attention per document
(``kernels.attention_block``), whose memory grows with the document's tokens (not the row's squared). The boundaries come as
``cu_seq_lens_q`` (transformers' keyword for packed sequences, handed down by the model's forward).
"""

from __future__ import annotations

import torch

from titan_ext import compat
from titan_ext.kernels.attention_block import attention_block, score_options
from titan_ext.kernels.varlen import sequence_spans


def document_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       sliding_window=None, cu_seq_lens_q=None, fallback=None, **kwargs):
    """Each document's causal attention (``cu_seq_lens_q`` over the ``B * T`` tokens of the batch); without
    boundaries, the model's own attention function (``fallback``)."""
    if cu_seq_lens_q is None:
        return fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        sliding_window=sliding_window, **kwargs)
    B, H, T, D = query.shape
    q, k, v = (x.transpose(1, 2).reshape(B * T, x.shape[1], x.shape[3]) for x in (query, key, value))
    out = packed_causal_attention(q, k, v, cu_seq_lens_q, scaling, sliding_window or None,
                                  dropout if module.training else 0.0, **score_options(kwargs))
    return out.reshape(B, T, H, -1), None


@torch.compiler.disable  # a host-side loop over documents: one graph break, no recompile per document count
def packed_causal_attention(q, k, v, cu_seqlens, scale=None, window: int | None = None, dropout: float = 0.0,
                            sinks=None, softcap=None):
    """``[total, H, D]`` packed sequences (``[total, H_kv, D]`` keys and values), each attending to itself
    (within ``window`` keys, itself included); ``sinks`` and ``softcap`` as the model's attention has them."""
    flash = q.is_cuda and dropout == 0.0 and q.dtype in (torch.bfloat16, torch.float16)  # flash-attention's dtypes
    varlen = compat.varlen_attention() if flash and sinks is None and softcap is None else None
    if varlen is not None:
        bounds = cu_seqlens.to(torch.int32)
        longest = int((bounds[1:] - bounds[:-1]).max())
        return varlen(q, k, v, bounds, bounds, longest, longest, scale=scale,
                      window_size=(window - 1 if window else -1, 0),  # keys before the query, as flash-attn counts them
                      enable_gqa=q.shape[1] != k.shape[1])
    outs = [attention_block(*(x[s:e].transpose(0, 1)[None] for x in (q, k, v)), 0, window, scale, dropout, sinks,
                            softcap)[0].transpose(0, 1) for s, e in sequence_spans(cu_seqlens)]
    return torch.cat(outs, dim=0)
