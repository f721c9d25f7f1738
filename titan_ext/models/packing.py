"""How one step's inputs reach an HF model: documents packed (``cu_seqlens`` for fla, a block-causal mask
and ``position_ids`` for transformers), and under context parallelism the rank's pieces.

Runs in every forward (``TitanCausalLM.forward``); the choices behind it were made at plan time
(``titan_ext.data.documents``, ``titan_ext.parallel.context_parallel``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from titan_ext import compat


def cu_seqlens(positions: torch.Tensor) -> torch.Tensor:
    """fla's ``cu_seqlens`` of a ``[B, T]`` batch flattened to one row: every position 0 starts a sequence.

    Its length follows the number of documents; it is marked dynamic, so a
    compiled block traces it once for any count.
    """
    flat = positions.reshape(-1)
    starts = (flat == 0).nonzero().squeeze(1)
    bounds = torch.cat([starts, starts.new_tensor([flat.numel()])]).to(torch.int32)
    compat.maybe_mark_dynamic(bounds, 0)
    return bounds


def block_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T, T]``, True where a token may attend: earlier or itself, in its own document.

    transformers derives the same mask from ``position_ids``, but only when
    some row holds two documents: a batch of one document per row would get
    plain causal attention instead, and compiled blocks a second graph.
    """
    document = (positions == 0).cumsum(dim=1)
    T = positions.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()
    return ((document[:, :, None] == document[:, None, :]) & causal)[:, None]


def document_attention_inputs(positions: torch.Tensor) -> dict:
    """A transformers model's keyword arguments for documents packed in ``[B, T]`` rows, where its attention
    runs each document alone (``kernels.document_attention``): rotary positions within each document, and the
    documents' bounds over the flattened batch as ``cu_seq_lens_q`` (which transformers hands its attention)."""
    return {"position_ids": positions, "cu_seq_lens_q": cu_seqlens(positions),
            "attention_mask": _MASKED_BY_LAYOUT.to(positions.device)}


def step_inputs(model: nn.Module, first: dict, positions, document_positions) -> dict:
    """The HF model's keyword arguments for one step under CP (``first``: its input ids or embeddings).

    ``positions`` are torchtitan's: each local token's place in the whole row. ``document_positions``
    (document masking) are the dataloader's for the whole rows, which torchtitan does not shard.
    Both are recorded in the model's ``PieceLayout`` for the bound attention and kernels.
    """
    layout = model.forward_plan.cp_layout
    layout.record(positions, document_positions)
    local = layout.local_document_positions
    parts = [part for mixer in model.mixers for part in mixer.parts]
    if any(part.cp_attention == "transformers" for part in parts):  # rotary at position_ids: global,
        if local is None:  # or within each document
            return {**first, "position_ids": positions}
        inputs = {**first, "position_ids": local, "attention_mask": _MASKED_BY_LAYOUT.to(local.device)}
        if any(part.cp_kernels or part.cp_halos for part in parts):  # a hybrid's recurrent or convolution layers:
            # the piece rows as one packed row
            inputs["cu_seq_lens_q"] = packed_cu_seqlens(layout)
        return inputs
    if local is None or not any(part.cp_kernels or part.cp_halos for part in parts):  # fla's attention reads the layout
        return first
    # recurrent mixers on packed documents: the piece rows as one row (fla's attention layers read the layout)
    flat = {name: x.reshape(1, -1, *x.shape[2:]) for name, x in first.items()}
    return {**flat, "cu_seqlens": packed_cu_seqlens(layout)}


_MASKED_BY_LAYOUT = torch.ones(1, 1, 1, 1, dtype=torch.bool)
"""The ``attention_mask`` of a transformers model under CP with documents, or with per-document attention
(``document_attention_inputs``). Its attention never reads an HF mask (``kernels.cp_attention.gathered_sdpa`` masks from the layout), but transformers would build one from
restarting ``position_ids`` for a batch where some row holds two documents and none otherwise: compiled
blocks would see a tensor one step and None the next, and recompile. A 4D mask is passed through as is."""


def packed_cu_seqlens(layout) -> torch.Tensor:
    """fla's ``cu_seqlens`` of this step's piece rows flattened into one: every piece row and every
    document start a sequence."""
    local = layout.local_document_positions
    piece_starts = torch.zeros_like(local, dtype=torch.bool)
    piece_starts[:, :: local.shape[1] // layout.per_rank] = True
    return cu_seqlens(local.masked_fill(piece_starts, 0))
