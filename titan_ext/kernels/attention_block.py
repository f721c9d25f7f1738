"""One block of causal softmax attention with what a transformers attention may add to it: attention sinks
(gpt-oss: one logit per head in every softmax's denominator) and logit softcapping (Gemma 2: ``cap * tanh(s /
cap)``). Without either, torch's SDPA; with them the scores are computed here, ``QUERY_BLOCK`` queries at a time
over the keys they reach, as transformers' eager attention computes them (concatenate the sink column, softmax,
drop it), so neither context parallelism nor per-document attention keeps a ``T x T`` matrix."""

from __future__ import annotations

import torch
import torch.nn.functional as F

QUERY_BLOCK = 1024
"""Queries per attention call: a block's mask and scores are ``QUERY_BLOCK x`` (the keys it reaches) at most."""

SINK_NAMES = ("s_aux", "sinks")
"""The keywords transformers' attention modules hand their attention function the sinks by (gpt-oss: ``s_aux``)."""


def score_options(kwargs: dict) -> dict:
    """``sinks`` and ``softcap`` taken out of an attention function's keywords (absent ones: None)."""
    sinks = [kwargs.pop(name) for name in SINK_NAMES if name in kwargs]
    return {"sinks": next((s for s in sinks if s is not None), None), "softcap": kwargs.pop("softcap", None)}


def attention_block(q, k, v, offset: int = 0, window: int | None = None, scale=None, dropout: float = 0.0,
                    sinks=None, softcap=None) -> torch.Tensor:
    """``q`` ``[B, H, Tq, D]`` over ``k``, ``v`` ``[B, H_kv, Tk, D]`` where query i sits at key position
    ``offset + i``: causal, and within ``window`` keys (itself included) where given."""
    gqa = q.shape[1] != k.shape[1]
    if sinks is None and softcap is None:
        mask = None
        if offset or (window is not None and k.shape[2] > window):
            mask = _allowed(q.shape[2], k.shape[2], offset, window, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout,
                                              scale=scale, enable_gqa=gqa)
    if gqa:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    blocks = []
    for start in range(0, q.shape[2], QUERY_BLOCK):
        rows = q[:, :, start: start + QUERY_BLOCK]
        end = offset + start + rows.shape[2]  # past the block's last query's key
        first = 0 if window is None else max(0, offset + start - window + 1)
        allowed = _allowed(rows.shape[2], end - first, offset + start - first, window, q.device)
        blocks.append(_scored(rows, k[:, :, first:end], v[:, :, first:end], allowed, scale, dropout, sinks, softcap))
    return torch.cat(blocks, dim=2)


def _allowed(queries: int, keys: int, offset: int, window: int | None, device) -> torch.Tensor:
    distance = torch.arange(queries, device=device)[:, None] + offset - torch.arange(keys, device=device)[None, :]
    allowed = distance >= 0
    return allowed if window is None else allowed & (distance < window)


def _scored(q, k, v, allowed, scale, dropout, sinks, softcap) -> torch.Tensor:
    """transformers' eager attention (Gemma 2's softcap before the mask; gpt-oss's sink column, dropped after the
    softmax), the softmax in fp32."""
    scores = (q @ k.transpose(-2, -1)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.float().masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = scores.softmax(dim=-1)[..., : k.shape[2]].to(v.dtype)
    return F.dropout(probs, p=dropout) @ v if dropout else probs @ v
