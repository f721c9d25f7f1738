"""A linear recurrence split across ranks (context parallelism), exact: pieces exchange their states.

For a recurrence whose state decays elementwise and then takes an update,
``S_t = exp(g_t) * S_{t-1} + k_t^T v_t`` (GLA: ``g`` per key channel;
RetNet, Mamba-2 and other diagonal-decay mixers are the same shape), a piece
of the sequence maps any incoming state ``h`` to ``D * h + F``: ``F`` is the
piece's final state from a zero start and ``D = exp(sum of g)`` its total decay.
So each rank

1. summarises its own piece as ``(F, D)``, from a zero start, with no collective;
2. all-gathers every piece's ``(F, D)`` in ONE collective per layer (one tensor of
   ``[pieces, B, H, K, V + 1]``);
3. folds the pieces before its own, in sequence order, into its initial state;
4. runs the unchanged kernel (fla's on CUDA) on its piece from that state.

The all-gather is differentiable (its backward sums each piece's gradient over
the ranks), so gradients reach every earlier piece through the states, and the
result equals one pass over the whole sequence. ``across_ranks`` wraps a kernel so; a mixer
with another kind of state reuses ``gather_pieces``, ``piece_order`` and the
fold with its own summary. A short convolution needs no state, only the
previous piece's last inputs (``previous_tails``, ``conv_across_ranks``).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

_FP32 = torch.float32


def diagonal_decay_summary(k: Tensor, v: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """``(F [B, H, K, V], D [B, H, K])`` of a ``[B, T, H, *]`` piece: its final state from zero, its total decay.

    ``F = sum_t exp(G_T - G_t) k_t^T v_t`` with ``G`` the cumulative log decay:
    every factor is at most 1, so long pieces stay finite in fp32.
    """
    dtype = torch.promote_types(k.dtype, _FP32)
    G = g.to(dtype).cumsum(dim=1)
    total = G[:, -1]
    F = torch.einsum("bthk,bthv->bhkv", k.to(dtype) * torch.exp(total[:, None] - G), v.to(dtype))
    return F, torch.exp(total)


def fold(state: Tensor, finals: Tensor, decays: Tensor) -> Tensor:
    """``state`` carried through the pieces ``finals``/``decays`` (``[n, B, H, K, V]`` / ``[n, B, H, K]``, in order)."""
    for final, decay in zip(finals, decays):
        state = decay[..., None] * state + final
    return state


def piece_order(rank: int, world: int, pieces_per_rank: int) -> list[int]:
    """Where this rank's pieces sit in the sequence: contiguous (1 piece: ``[rank]``), or torchtitan's
    head-tail load balancing (2 pieces: ``[rank, 2 * world - 1 - rank]``)."""
    if pieces_per_rank == 1:
        return [rank]
    if pieces_per_rank == 2:
        return [rank, 2 * world - 1 - rank]
    raise ValueError(f"pieces_per_rank must be 1 or 2, not {pieces_per_rank}")


def in_sequence_order(world: int, pieces_per_rank: int) -> list[int]:
    """For each piece of the sequence, in order, its slot among the gathered pieces (rank-major:
    rank ``r``'s ``i``-th piece is slot ``r * pieces_per_rank + i``)."""
    slot = {p: r * pieces_per_rank + i for r in range(world) for i, p in enumerate(piece_order(r, world, pieces_per_rank))}
    return [slot[p] for p in range(world * pieces_per_rank)]


def gather_pieces(summary: Tensor, group) -> Tensor:
    """Every rank's ``summary`` stacked in rank order (``[world, *summary.shape]``), differentiably."""
    from titan_ext import compat

    world = torch.distributed.get_world_size(group)
    return compat.all_gather_autograd(summary.contiguous(), group).view(world, *summary.shape)


def piece_summaries(k: Tensor, v: Tensor, g: Tensor, pieces_per_rank: int) -> Tensor:
    """``[pieces, B, H, K, V + 1]``: each of this rank's pieces (back to back along T, equal lengths)
    as ``F`` with ``D`` in the last column, so all of it travels in one collective."""
    summaries = []
    for k_piece, v_piece, g_piece in zip(*(x.chunk(pieces_per_rank, dim=1) for x in (k, v, g))):
        F, D = diagonal_decay_summary(k_piece, v_piece, g_piece)
        summaries.append(torch.cat([F, D[..., None]], dim=-1))
    return torch.stack(summaries)


def incoming_states(every: Tensor, rank: int, pieces_per_rank: int, initial_state: Tensor | None = None) -> list[Tensor]:
    """The exact state ``[B, H, K, V]`` entering each of ``rank``'s pieces, from every rank's summaries
    (``[world, pieces, B, H, K, V + 1]``) and the sequence's own initial state (before piece 0)."""
    world = every.shape[0]
    ordered = every.flatten(0, 1)[in_sequence_order(world, pieces_per_rank)]
    finals, decays = ordered[..., :-1], ordered[..., -1]
    # Every rank must take part in the all-gather's backward (a reduce-scatter), also the one whose first
    # piece folds nothing: a zero-weighted term keeps the gathered tensor in its graph.
    start = finals[0] * 0 if initial_state is None else initial_state.to(finals.dtype) + finals[0] * 0
    return [fold(start, finals[:p], decays[:p]) for p in piece_order(rank, world, pieces_per_rank)]


def across_ranks(kernel, gate: str, group, pieces_per_rank: int = 1):
    """``kernel`` (fla's ``chunk_gla``/``fused_recurrent_gla`` call contract, keyword arguments;
    ``gate`` names its decay argument) on this rank's pieces of sequences split over ``group``."""
    rank = torch.distributed.get_rank(group)

    @functools.wraps(kernel)
    def kernel_across_ranks(q, k, v, **kwargs):
        if kwargs.get("cu_seqlens") is not None:
            raise ValueError("packed sequences (cu_seqlens) cannot be split across context-parallel ranks")
        g, state_v_first = kwargs.pop(gate), kwargs.get("state_v_first", False)
        summaries = gather_pieces(piece_summaries(k, v, g, pieces_per_rank), group)
        states = incoming_states(summaries, rank, pieces_per_rank, kwargs.pop("initial_state", None))
        outputs, final = [], None
        pieces = zip(*(x.chunk(pieces_per_rank, dim=1) for x in (q, k, v, g)))
        for state, (q_piece, k_piece, v_piece, g_piece) in zip(states, pieces):
            state = state.transpose(-1, -2) if state_v_first else state
            state = state.to(torch.promote_types(q.dtype, _FP32)).contiguous()  # fla takes fp32 states
            o, final = kernel(q=q_piece, k=k_piece, v=v_piece, **{gate: g_piece}, initial_state=state, **kwargs)
            outputs.append(o)
        return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), final

    return kernel_across_ranks


def previous_tails(x: Tensor, width: int, group, pieces_per_rank: int = 1) -> list[Tensor]:
    """For each of this rank's pieces of ``x`` (``[B, T, ...]``, pieces back to back along T), the
    last ``width`` steps of the piece before it in the sequence (zeros before the first piece):
    the halo a causal convolution of ``width + 1`` taps needs. One all-gather, differentiable."""
    rank, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    T = x.shape[1] // pieces_per_rank
    if width > T:
        raise ValueError(f"a piece of {T} tokens cannot hold a halo of {width}; use longer sequences")
    tails = torch.stack([piece[:, T - width:] for piece in x.chunk(pieces_per_rank, dim=1)])
    every = gather_pieces(tails, group)  # [world, pieces, B, width, ...]
    ordered = every.flatten(0, 1)[in_sequence_order(world, pieces_per_rank)]
    anchor = ordered[0] * 0  # keeps every rank in the all-gather's backward (see ``incoming_states``)
    return [anchor if p == 0 else ordered[p - 1] + anchor for p in piece_order(rank, world, pieces_per_rank)]


def conv_across_ranks(kernel, group, pieces_per_rank: int = 1):
    """fla's ``causal_conv1d`` (keyword arguments, ``x`` ``[B, T, D]``) on this rank's pieces of
    sequences split over ``group``: each piece starts from the previous piece's last inputs."""

    @functools.wraps(kernel)
    def conv_from_halo(x, weight, residual=None, initial_state=None, cu_seqlens=None, **kwargs):
        if cu_seqlens is not None or initial_state is not None:
            raise ValueError("a convolution split across context-parallel ranks takes no cu_seqlens or cache")
        halos = previous_tails(x, weight.shape[-1] - 1, group, pieces_per_rank)
        residuals = [None] * pieces_per_rank if residual is None else residual.chunk(pieces_per_rank, dim=1)
        outputs, final = [], None
        for halo, x_piece, residual_piece in zip(halos, x.chunk(pieces_per_rank, dim=1), residuals):
            # fla's conv state holds the last W inputs, newest last, and reads state[..., 1:]
            state = torch.nn.functional.pad(halo.transpose(1, 2), (1, 0)).contiguous()
            y, final = kernel(x=x_piece, weight=weight, residual=residual_piece, initial_state=state, **kwargs)
            outputs.append(y)
        return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), final

    return conv_from_halo
