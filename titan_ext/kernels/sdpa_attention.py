"""fla's softmax ``Attention`` without the flash-attn package: PyTorch SDPA behind flash-attn's API.

fla's ``Attention`` layer calls ``flash_attn_func`` (a module global of
``fla.layers.attn``) and refuses to build when it is ``None``. When
flash-attn is missing, titan_ext's own fla Transformer is built with
``sdpa_attn_func`` in its place (``host_patches.BUILD``, during construction
only) and its Attention modules call it (``titan_ext.kernels.global_names``):
flash-attn's call contract over ``torch.nn.functional.scaled_dot_product_attention``.
The layer itself (projections, qk_norm, rotary, parameter names) stays fla's,
so the math and the checkpoints are fla's. With flash-attn installed nothing
changes.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from titan_ext.kernels.varlen import sequence_spans


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def sdpa_attn_func(q, k, v, causal: bool = True, window_size: tuple[int, int] = (-1, -1)) -> torch.Tensor:
    """``flash_attn_func`` over SDPA: [B, T, H, D] in and out, GQA when k/v have fewer heads.

    As in flash-attn, a causal query attends to keys aligned to the end of
    the key sequence, and ``window_size=(left, 0)`` limits it to the ``left``
    keys before it (fla passes ``window_size - 1``).
    """
    if not causal:
        raise ValueError("titan_ext's SDPA attention is causal only; fla's Attention always passes causal=True")
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    left = window_size[0]
    q_len, k_len = q.shape[-2], k.shape[-2]
    mask = None
    if left >= 0 or q_len != k_len:
        rows = torch.arange(q_len, device=q.device)[:, None] + (k_len - q_len)
        cols = torch.arange(k_len, device=q.device)[None, :]
        mask = cols <= rows
        if left >= 0:
            mask = mask & (rows - cols <= left)
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=q.shape[1] != k.shape[1]
    )
    return o.transpose(1, 2)


@torch.compiler.disable  # a loop over the sequences: one graph break, instead of a recompile per document count
def sdpa_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, causal: bool = True,
    window_size: tuple[int, int] = (-1, -1), **unused,
) -> torch.Tensor:
    """``flash_attn_varlen_func`` over SDPA: packed ``[total, H, D]`` sequences, each attending only to itself."""
    if unused:
        raise ValueError(f"titan_ext's SDPA varlen attention does not take {sorted(unused)}; install flash-attn")
    outs = [
        sdpa_attn_func(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], causal, window_size)[0]
        for (qs, qe), (ks, ke) in zip(sequence_spans(cu_seqlens_q), sequence_spans(cu_seqlens_k))
    ]
    return torch.cat(outs, dim=0)
