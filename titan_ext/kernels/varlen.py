"""fla's packed-sequence layout (``cu_seqlens``), for the torch kernels that run each sequence alone
(``sequence_spans``) or all at once (``token_sequences``)."""

from __future__ import annotations

import torch


def sequence_spans(
    cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None = None, batch_size: int = 1
) -> list[tuple[int, int]]:
    """``(start, end)`` of each packed sequence; fla packs them into one row, so ``batch_size`` must be 1."""
    check_packed_batch(batch_size)
    bounds = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def check_packed_batch(batch_size: int) -> None:
    """fla packs sequences into one row: with ``cu_seqlens`` the batch size must be 1 (fla's message)."""
    if batch_size != 1:
        raise ValueError(f"With `cu_seqlens` the batch size must be 1, not {batch_size}.")


def token_sequences(cu_seqlens: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of the ``length`` packed tokens' sequence index and position in that sequence, by search:
    no loop over sequences and no host sync, so compiled code is one graph for any number of them."""
    ramp = torch.arange(length, device=cu_seqlens.device)
    sequence = torch.searchsorted(cu_seqlens[1:], ramp, right=True)
    return sequence, ramp - cu_seqlens[sequence]
