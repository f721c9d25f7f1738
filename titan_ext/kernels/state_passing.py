"""A linear recurrence split across ranks (context parallelism), exact: pieces exchange their states.

Every recurrence titan_ext splits is linear in its state and its values
jointly, with the value columns independent of each other. So a piece of a
sequence maps the state ``h`` (``[K, V]`` per head) it receives to ``M h + F``,
``F`` being its final state from a zero start, and each of its tokens reads
``h`` through a row ``c_t``: its output is its output from zero plus ``c_t h``.
Each rank

1. runs the unchanged kernel (fla's on CUDA) on its pieces from a zero state,
   and summarises each piece as ``[F | M]``, with no collective;
2. all-gathers every piece's summary in ONE collective per layer;
3. folds the pieces before each of its own, in sequence order, into that
   piece's incoming state;
4. adds each token's read of its incoming state, ``c_t h``, to its output.

Two kinds of recurrence:

* ``DiagonalDecay`` (GLA; RetNet and Mamba-2 have the same shape): the state
  decays per key channel (or per head: simple GLA's scalar gate), ``M`` is a diagonal (``exp`` of the summed log decay),
  and ``F`` and ``c_t`` are closed forms, one einsum each.
* ``AffineState`` (the gated delta rule: ``M`` is the product of
  ``exp(g_t) (I - beta_t k_t k_t^T)``, a full ``K x K`` matrix): the kernel
  computes them itself. With its values widened by ``K`` zero columns and the
  initial state ``[0 | I]``, its final state is ``[F | M]`` and its outputs are
  ``[o | c]``: one kernel call, ``(V + K) / V`` of the plain call's work.

Packed documents (``cu_seqlens`` over rows flattened into one, fla's layout;
``PieceLayout.continues`` says whether each piece's first token continues a
document of the piece before it): a piece holding a document start hands on
only its last document's state (``M = 0``), and its tokens from the first
start on read nothing from before it.

The all-gather is differentiable (its backward sums each piece's gradient over
the ranks), so gradients reach every earlier piece through the states, and
the result equals one pass over the whole sequence. A short convolution
needs no state, only the previous piece's last inputs, which it convolves
as a prefix of its own (``conv_across_ranks``).

Shapes: a rank's ``B`` rows hold ``per_rank`` pieces of ``P`` tokens each,
back to back; the kernels here see them as ``R = B * per_rank`` rows of ``P``
(row ``b * per_rank + i`` is batch row ``b``'s ``i``-th piece), unflattened.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

_FP32 = torch.float32


@dataclass(frozen=True)
class DiagonalDecay:
    """A state decaying per key channel; ``gate`` names the kernel's log-decay argument (``[B, T, H, K]``, or
    ``[B, T, H]``: one per head)."""

    gate: str


@dataclass(frozen=True)
class AffineState:
    """Any state update linear in (state, values) with independent value columns (the gated delta rule)."""


class PieceLayout:
    """This rank's place in sequences split over ``group``, shared by one model's bound kernels.

    ``per_rank`` pieces of each row per rank (torchtitan's layouts: ``piece_order``). For each
    step the model's forward records the tokens' global ``positions`` (``[B, T_local]``) and,
    with document masking, the whole rows' ``document_positions`` (``[B, T]``, each token's
    index in its document; torchtitan does not shard them).
    """

    def __init__(self, group, per_rank: int):
        self.group, self.per_rank = group, per_rank
        self.rank = torch.distributed.get_rank(group)
        self.world = torch.distributed.get_world_size(group)
        self._micro_batch, self._recorded = None, {}
        self.record(None, None)
        self.expected: dict[str, int] = {}
        """Calls of each context-parallel path one forward must make (one per layer using it)."""
        self.ran: dict[str, int] = {}
        self.traced = self.checked = False

    def mark(self, path: str) -> None:
        """A bound layer's context-parallel ``path`` runs (``check_paths``); under compile, counted where it is traced."""
        from titan_ext import compat

        traced = torch.compiler.is_compiling()
        compat.once_per_run(lambda: self._count(path, traced))

    def _count(self, path: str, traced: bool) -> None:
        self.ran[path] = self.ran.get(path, 0) + 1
        self.traced |= traced

    def check_paths(self) -> str | None:
        """After the first forward: which paths ran fewer times than layers use them (a layer left unbound
        would attend or recur within this rank's piece only), or None. Compiled blocks of one class may
        share one trace, so there each path must have been traced at least once."""
        if self.checked:
            return None
        self.checked = True
        short = {path: self.ran.get(path, 0) for path, calls in self.expected.items()
                 if self.ran.get(path, 0) < (1 if self.traced else calls)}
        if not short:
            return None
        return ", ".join(f"{path}: {ran} of {self.expected[path]} layers" for path, ran in short.items())

    def record(self, positions: Tensor | None, document_positions: Tensor | None) -> None:
        """One step's positions, and what the bound kernels derive from them, once per step."""
        self.positions = None if positions is None else positions.long()
        self.document_positions = document_positions
        self.local_document_positions = None  # each local token's position in its document
        if document_positions is not None:
            self.local_document_positions = document_positions.gather(1, self.positions)
        self._recorded[self._micro_batch] = self.positions, self.document_positions, self.local_document_positions

    def micro_batch(self, index: int | None) -> None:
        """Select micro-batch ``index``'s record (a pipeline stage's, before its forward or backward).

        A pipeline stage runs several micro-batches' forwards before their backwards, and activation
        checkpointing recomputes a block's forward inside its backward: that recompute must read its
        own micro-batch's positions and documents, not the last forward's. Each record is kept under
        the micro-batch it was made for."""
        self._micro_batch = index
        if index in self._recorded:
            self.positions, self.document_positions, self.local_document_positions = self._recorded[index]

    def continues(self) -> Tensor | None:
        """``[B * per_rank]``: whether each local piece's first token continues a document (None:
        no document masking, so every piece continues the one before it)."""
        first = self.first_positions()
        return None if first is None else first != 0

    def first_positions(self) -> Tensor | None:
        """``[B * per_rank]``: each local piece's first token's position in its document (None: no
        document masking)."""
        if self.local_document_positions is None:
            return None
        size = self.local_document_positions.shape[1] // self.per_rank
        return self.local_document_positions[:, ::size].flatten()

    def rows(self, x: Tensor) -> int:
        """How many piece rows ``x`` holds: batch x pieces per rank, or, packed into one row (documents),
        one per ``continues``."""
        continues = self.continues()
        return x.shape[0] * self.per_rank if continues is None else continues.shape[0]


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


def fold(state: Tensor, summaries: Tensor, value_dim: int) -> Tensor:
    """``state`` (``[B, H, K, V]``) carried through ``summaries`` (``[n, B, H, K, V + m]``, ``[F | M]``, in
    order; ``m`` is 1 for a diagonal ``M``, ``K`` for a full one: ``M * h`` and ``M @ h`` agree at 1)."""
    for summary in summaries:
        final, step = summary[..., :value_dim], summary[..., value_dim:]
        state = (step * state if step.shape[-1] == 1 else step @ state) + final
    return state


def every_piece(rows: Tensor, layout: PieceLayout) -> Tensor:
    """Every piece of the sequences, in sequence order (``[pieces, B, ...]``), from each rank's piece
    rows (``[R, ...]``): one all-gather."""
    mine = rows.unflatten(0, (rows.shape[0] // layout.per_rank, layout.per_rank)).transpose(0, 1)
    return gather_pieces(mine, layout.group).flatten(0, 1)[in_sequence_order(layout.world, layout.per_rank)]


def as_piece_rows(pieces: list[Tensor]) -> Tensor:
    """This rank's per-piece tensors (``[B, ...]`` each, in its piece order) as piece rows ``[R, ...]``."""
    return torch.stack(pieces, dim=1).flatten(0, 1)


def incoming_states(summaries: Tensor, layout: PieceLayout, value_dim: int, initial_state: Tensor | None = None) -> Tensor:
    """The exact state ``[R, H, K, V]`` entering each local piece row, from this rank's piece summaries
    (``[R, H, K, V + m]``), all-gathered, and the sequence's own initial state (before piece 0)."""
    every = every_piece(summaries, layout)
    # Every rank must take part in the all-gather's backward (a reduce-scatter), also the one whose first
    # piece folds nothing: a zero-weighted term keeps the gathered tensor in its graph.
    start = every[0, ..., :value_dim] * 0
    if initial_state is not None:
        start = start + initial_state.to(start.dtype)
    return as_piece_rows([fold(start, every[:p], value_dim) for p in piece_order(layout.rank, layout.world, layout.per_rank)])


def document_starts(cu_seqlens: Tensor, continues: Tensor, size: int) -> Tensor:
    """``[R, P]``: where a document starts in each piece row (flattened into ``cu_seqlens``' one
    row, whose sequences also begin at every row): every sequence start, except a row's first
    token when it continues the piece before."""
    rows = continues.shape[0]
    flat = torch.zeros(rows * size, dtype=torch.bool, device=cu_seqlens.device)
    starts = flat.index_fill(0, cu_seqlens[:-1].long(), True).view(rows, size)
    return torch.cat([~continues[:, None], starts[:, 1:]], dim=1)


def across_ranks(kernel, recurrence: DiagonalDecay | AffineState, layout: PieceLayout):
    """``kernel`` (an fla chunk kernel's call contract, keyword arguments) on this rank's pieces of
    sequences split over ``layout.group``."""
    summarise = _diagonal_pieces if isinstance(recurrence, DiagonalDecay) else _affine_pieces

    @functools.wraps(kernel)
    def kernel_across_ranks(q, k, v, **kwargs):
        if kwargs.pop("output_final_state", False):
            raise ValueError("a sequence split across context-parallel ranks has no final state on one rank")
        initial_state = kwargs.pop("initial_state", None)
        if initial_state is not None and kwargs.get("state_v_first", False):
            initial_state = initial_state.transpose(-1, -2)
        continues = layout.continues()
        if kwargs.get("cu_seqlens") is not None and continues is None:
            raise ValueError("packed sequences (cu_seqlens) under context parallelism need the step's document layout")
        if continues is not None and initial_state is not None:
            raise ValueError("packed documents under context parallelism start from zero (no initial_state)")
        rows = layout.rows(q)
        o, reads, summaries = summarise(kernel, recurrence, q, k, v, rows, continues, kwargs)
        incoming = incoming_states(summaries, layout, v.shape[-1], initial_state)
        o = o.to(incoming.dtype) + torch.einsum("rthk,rhkv->rthv", reads.to(incoming.dtype), incoming)
        return o.reshape(v.shape).to(v.dtype), None

    return kernel_across_ranks


def _as_rows(x: Tensor, rows: int) -> Tensor:
    """``[B, T, ...]`` -> ``[rows, T * B / rows, ...]``: rows of consecutive tokens."""
    return x.reshape(rows, -1, *x.shape[2:])


def _diagonal_pieces(kernel, recurrence: DiagonalDecay, q, k, v, rows, continues, kwargs):
    """GLA-like: the kernel's outputs from zero, and the reads and summaries in closed form.

    With ``G_t`` the cumulative log decay of a piece row up to token ``t``:
    ``c_t = scale * q_t * exp(G_t)`` (until the first document start),
    ``F = sum_t exp(G_P - G_t) k_t^T v_t`` (from the last start) and ``M = exp(G_P)``
    (0 with a start). Every exponent is at most 0, so long pieces stay finite.
    """
    g = kwargs.pop(recurrence.gate)
    if kwargs.get("gv") is not None:
        raise ValueError("context parallelism splits GLA states with a key-channel gate only (no gv)")
    packed = kwargs.get("cu_seqlens") is not None
    inputs = {"q": q, "k": k, "v": v, recurrence.gate: g}
    if not packed:  # each piece row from zero, as a batch of rows
        inputs = {name: _as_rows(x, rows) for name, x in inputs.items()}
    o, _ = kernel(**inputs, **kwargs)
    if g.dim() < k.dim():  # one decay per head (simple GLA, Mamba-2): the same on every key channel
        g = g[..., None].expand(k.shape)
    dtype = torch.promote_types(q.dtype, _FP32)
    q, k, v, g = (_as_rows(x, rows).to(dtype) for x in (q, k, v, g))
    scale = kwargs.get("scale") or q.shape[-1] ** -0.5
    G = g.cumsum(dim=1)
    total = G[:, -1]
    if continues is None:
        reads, since_last_start, no_start = 1, 1, 1
    else:
        starts = document_starts(kwargs["cu_seqlens"], continues, q.shape[1])
        reads = (starts.cumsum(dim=1) == 0)[..., None, None]  # before the row's first start: none if it opens one
        later = starts.flip(1).cumsum(dim=1).flip(1) - starts.to(torch.int64)  # starts after each token
        since_last_start = (later == 0)[..., None, None]
        no_start = reads[:, -1]
    c = scale * q * torch.exp(G) * reads
    F = torch.einsum("bthk,bthv->bhkv", k * torch.exp(total[:, None] - G) * since_last_start, v)
    D = torch.exp(total) * no_start
    return _as_rows(o, rows), c, torch.cat([F, D[..., None]], dim=-1)


def _affine_pieces(kernel, recurrence: AffineState, q, k, v, rows, continues, kwargs):
    """The kernel's own ``[F | M]`` and reads: values widened by K zero columns, initial state ``[0 | I]``
    (``[0 | 0]`` for a piece row that starts a document, and for later documents of a row)."""
    K, V, state_v_first = k.shape[-1], v.shape[-1], kwargs.get("state_v_first", False)
    heads = v.shape[2]
    widened = torch.cat([v, v.new_zeros(*v.shape[:-1], K)], dim=-1)
    eye = torch.eye(K, dtype=_FP32 if v.dtype != torch.float64 else v.dtype, device=v.device)
    start = torch.cat([eye.new_zeros(K, V), eye], dim=-1).expand(rows, heads, K, V + K)
    if continues is not None:
        start = start * continues[:, None, None, None]
    cu_seqlens = kwargs.get("cu_seqlens")
    if cu_seqlens is None:  # each piece row from [0 | I], as a batch of rows
        inputs = {name: _as_rows(x, rows) for name, x in kwargs.items() if name in ("g", "beta")}
        initial = start
        o, final = kernel(q=_as_rows(q, rows), k=_as_rows(k, rows), v=_as_rows(widened, rows),
                          **{**kwargs, **inputs}, initial_state=_v_first(initial, state_v_first), output_final_state=True)
    else:  # one packed row: each sequence that opens a piece row from that row's start, the others from zero
        size = q.shape[1] // rows
        bos = cu_seqlens[:-1].long()
        opens = (bos % size == 0)[:, None, None, None]
        initial = start[bos // size] * opens
        o, final = kernel(q=q, k=k, v=widened, **kwargs, initial_state=_v_first(initial, state_v_first),
                          output_final_state=True)
        last = torch.arange(1, rows + 1, device=bos.device) * size - 1  # each row's last token
        final = final[torch.searchsorted(bos, last, right=True) - 1]  # ... and its sequence's final state
    o = _as_rows(o, rows)
    return o[..., :V], o[..., V:], _v_first(final, state_v_first)


def _v_first(state: Tensor, state_v_first: bool) -> Tensor:
    """A ``[..., K, V]`` state in the kernel's layout (``[..., V, K]`` with fla's ``state_v_first``), or back."""
    return state.transpose(-1, -2).contiguous() if state_v_first else state


def previous_tails(x: Tensor, width: int, layout: PieceLayout) -> Tensor:
    """For each piece row of ``x`` (``[R, P, ...]``), the last ``width`` steps of the piece before it in
    the sequence (zeros before the first piece): the halo a causal convolution of ``width + 1`` taps
    needs. One all-gather, differentiable."""
    size = x.shape[1]
    if width > size:
        raise ValueError(f"a piece of {size} tokens cannot hold a halo of {width}; use longer sequences")
    every = every_piece(x[:, size - width:], layout)
    anchor = every[0] * 0  # keeps every rank in the all-gather's backward (see ``incoming_states``)
    return as_piece_rows([anchor if p == 0 else every[p - 1] + anchor
                          for p in piece_order(layout.rank, layout.world, layout.per_rank)])


def conv_across_ranks(kernel, layout: PieceLayout):
    """fla's ``causal_conv1d`` (keyword arguments, ``x`` ``[B, T, D]``) on this rank's pieces of
    sequences split over ``layout.group``: each piece row convolves the previous piece's last inputs
    as a prefix of its own (zeros for those of another document: all where the piece starts one,
    the first few where a document starts within the previous piece's last inputs), and drops the
    prefix's outputs."""

    @functools.wraps(kernel)
    def conv_from_halo(x, weight, residual=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                       **kwargs):
        if initial_state is not None or output_final_state:
            raise ValueError("a convolution split across context-parallel ranks takes no cache and gives no final state")
        kwargs.pop("cu_seqlens_cpu", None), kwargs.pop("chunk_indices", None)  # of the unwidened rows
        first, rows = layout.first_positions(), layout.rows(x)
        width = weight.shape[-1] - 1
        pieces = _as_rows(x, rows)
        halos = previous_tails(pieces, width, layout)
        if first is not None:  # halo step j is the token width - j before the piece: in its document or not
            same_document = first[:, None] >= torch.arange(width, 0, -1, device=first.device)
            halos = halos * same_document.view(rows, width, *[1] * (halos.dim() - 2)).to(halos.dtype)
        widened = torch.cat([halos, pieces], dim=1)
        if residual is not None:
            residual = _as_rows(residual, rows)
            residual = torch.cat([residual.new_zeros(halos.shape), residual], dim=1)
        if cu_seqlens is None:
            y, _ = kernel(x=widened, weight=weight, residual=residual, **kwargs)
        else:  # one packed row: each sequence start moves by the prefixes before it, a row's first to its
            size = pieces.shape[1]  # prefix (zeros, where the row starts a document, are a fresh start)
            bos = cu_seqlens[:-1].long()
            row = bos // size
            moved = bos + row * width + width * (bos % size != 0).long()
            end = moved.new_tensor([rows * (size + width)])
            y, _ = kernel(x=widened.reshape(1, -1, *x.shape[2:]),
                          weight=weight, residual=None if residual is None else residual.reshape(1, -1, *x.shape[2:]),
                          cu_seqlens=torch.cat([moved, end]).to(cu_seqlens.dtype), **kwargs)
            y = y.view(rows, size + width, *x.shape[2:])
        return y[:, width:].reshape(x.shape), None

    return conv_from_halo
