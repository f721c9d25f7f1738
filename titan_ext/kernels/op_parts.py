"""Pieces every kernel-as-torch-op module shares: custom ops cannot return None, nor an input itself."""

from __future__ import annotations

import torch
from torch import Tensor


def empty(like: Tensor) -> Tensor:
    """The stand-in for an absent tensor output."""
    return like.new_empty(0, dtype=torch.float32)


def present(x: Tensor | None) -> Tensor | None:
    """An output back as fla's drivers pass it: None where the op returned the stand-in."""
    return x if x is not None and x.numel() else None


def fresh(x: Tensor) -> Tensor:
    """A fake output shaped as ``x``, contiguous (as every real output is made)."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def chunk_indices(fla, cu_seqlens, chunk_size, cu_seqlens_cpu=None):
    """fla's chunk indices of packed sequences (None without ``cu_seqlens``)."""
    if cu_seqlens is None:
        return None
    return fla.prepare_chunk_indices(cu_seqlens, chunk_size, cu_seqlens_cpu=cu_seqlens_cpu)
