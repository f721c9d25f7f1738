"""What runs in every forward under context parallelism, once ``titan_ext.parallel.context_parallel`` has bound it:
torch's ring attention as a module of its own, attention over all-gathered keys and values where a mask
does more than causality (for MLA, all-gathered latents expanded on each rank), and fla's
``Attention.forward`` at the tokens' global positions."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_ext import compat
from titan_ext.kernels.attention_block import QUERY_BLOCK, attention_block
from titan_ext.kernels.state_passing import in_sequence_order


class RingSDPA(nn.Module):
    """Causal SDPA as a module of its own, for torchtitan's ``apply_cp_to_attention_module``: its inputs
    become sequence-sharded DTensors and torch's CP dispatcher runs the ring. One per model, outside its
    module tree (no parameters; checkpoints, FSDP and AC never see it)."""

    def __init__(self, pieces_per_rank: int):
        super().__init__()
        self.head_tail = pieces_per_rank > 1
        self.options = compat.torch_cp_options()._cp_options

    def forward(self, query, key, value, scale=None):
        # torchtitan's input sharding tells torch's ring the piece layout; it must be this model's
        if self.options.enable_load_balance != self.head_tail:
            raise RuntimeError(
                f"torch's ring attention expects {'head-tail' if self.options.enable_load_balance else 'contiguous'} "
                f"pieces, this model was built for {'head-tail' if self.head_tail else 'contiguous'} ones: shard the "
                "inputs with torchtitan's prepare_context_parallel_input and the job's load balancer"
            )
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale)


class OneAttention:
    """Stands in for transformers' attention registry inside the bound attention modules."""

    def __init__(self, fn):
        self.fn = fn

    def get_interface(self, name, default):
        return self.fn


def gathered_sdpa(query, key, value, layout, scale=None, window: int | None = None, dropout=0.0, sinks=None,
                  softcap=None):
    """Masked causal attention of this rank's queries over every rank's keys and values (``[B, H, T, D]``).

    K and V are all-gathered differentiably and put in sequence order; each block of local queries attends to
    the keys its global positions (``layout.positions``) allow: causal, within a sliding ``window`` (fla's
    ``window_size``), within each packed document (``per_document_sdpa``). K and V of the whole sequence are
    held for the duration of one layer's attention; no mask grows with the square of the sequence.
    """
    keys, values = (gathered_sequence(x, layout) for x in (key, value))
    return per_document_sdpa(query, keys, values, layout, scale, window, dropout, sinks, softcap)


def gathered_sequence(x, layout, dim: int = 2):
    """Every rank's pieces of ``x`` (sequence along ``dim``) in sequence order: an all-gather whose backward
    sums each piece's gradient over the ranks and hands it back to its rank (a reduce-scatter)."""
    whole = compat.all_gather_autograd(x.contiguous(), layout.group, dim=dim)
    if layout.per_rank == 1:
        return whole
    slots = in_sequence_order(layout.world, layout.per_rank)  # gathered in rank order
    return torch.cat([whole.chunk(len(slots), dim=dim)[s] for s in slots], dim=dim)


def gathered_latents(latent, rotary_key, layout):
    """MLA's compressed keys and values of the whole sequence (``[B, 1, T, kv_lora_rank]`` and the rotary key
    every head shares, ``[B, 1, T, qk_rope_head_dim]``, from this rank's ``T_local``), in one all-gather: each
    rank then expands them to its heads' keys and values (``kv_b_proj``), which would be
    ``heads * (qk_nope + qk_rope + v)`` dims per token to send instead of ``kv_lora_rank + qk_rope``.

    Under TP the latent is a replicated DTensor (its norm's output); its local tensor is gathered and placed
    back, so the TP ranks' gradients for it are still summed where it meets the colwise ``kv_b_proj``."""
    from torch.distributed.tensor import DTensor

    local = latent.to_local() if isinstance(latent, DTensor) else latent
    rank = local.shape[-1]
    whole = gathered_sequence(torch.cat([local, rotary_key], dim=-1), layout)
    nope, rotary = whole.split([rank, whole.shape[-1] - rank], dim=-1)
    if isinstance(latent, DTensor):
        nope = DTensor.from_local(nope, latent.device_mesh, latent.placements, run_check=False)
    return nope, rotary


@torch.compiler.disable  # a host-side loop over pieces and documents: one graph break, no recompile per count
def per_document_sdpa(query, keys, values, layout, scale=None, window: int | None = None, dropout=0.0, sinks=None,
                      softcap=None):
    """``gathered_sdpa``'s attention, one call per (row, piece, document, block of queries): each block of a
    document's local queries attends to that document's keys up to the block's last query (causal, within
    ``window``; with ``sinks`` and ``softcap`` where the model has them: ``attention_block``), so no mask grows
    with the square of the row (a block's is ``QUERY_BLOCK`` x its keys, and with a window at most
    ``QUERY_BLOCK`` x ``QUERY_BLOCK + window``). Without documents (``layout.document_positions`` None: a
    sliding window alone) each row is one document."""
    out = query.new_empty(*query.shape[:3], values.shape[-1])
    documents = layout.document_positions
    if documents is None:
        documents = torch.arange(keys.shape[2]).expand(query.shape[0], -1)
    for row, (positions, documents) in enumerate(zip(layout.positions.tolist(), documents.tolist())):
        for local, first, last in _query_blocks(positions, documents, window):
            q = query[row: row + 1, :, local: local + last - first[1]]
            k, v = (x[row: row + 1, :, first[0]: last] for x in (keys, values))
            out[row: row + 1, :, local: local + q.shape[2]] = attention_block(
                q, k, v, first[1] - first[0], window, scale, dropout, sinks, softcap)  # keys before the first query
    return out


def _query_blocks(positions: list[int], documents: list[int], window: int | None):
    """``(local start, (first key, first query), end)`` in global positions for each block of consecutive
    local queries in one document: ``positions`` are the local tokens' global positions (runs of consecutive
    ones: the pieces), ``documents`` the row's positions within documents (0 starts one)."""
    start = 0
    while start < len(positions):
        end = start + 1  # the piece: consecutive global positions
        while end < len(positions) and positions[end] == positions[end - 1] + 1:
            end += 1
        g = positions[start]
        while g <= positions[end - 1]:
            document = g - documents[g]  # this document's first token
            stop = g + 1  # the document's end within the piece
            while stop <= positions[end - 1] and documents[stop] != 0:
                stop += 1
            for block in range(g, stop, QUERY_BLOCK):
                block_end = min(block + QUERY_BLOCK, stop)
                first_key = document if window is None else max(document, block - window + 1)
                yield start + block - positions[start], (first_key, block), block_end
            g = stop
        start = end


def fla_attention_forward(self, hidden_states, attention_mask=None, past_key_values=None, output_attentions=False,
                          use_cache=False, layout=None, attend=None, cu_seqlens=None, **kwargs):
    """fla's ``Attention.forward`` for training under CP: the same projections, qk-norm, rotary
    (at the tokens' global positions, or within their documents) and causal (windowed) attention,
    by ``attend`` (``attention_across_ranks``).

    In a hybrid with packed documents the recurrent layers take this rank's rows flattened into one
    (``cu_seqlens``): here they are this rank's rows again, since the layout holds their documents."""
    from titan_ext.kernels.rotary import rotate_at  # imports fla

    if attention_mask is not None or past_key_values is not None:
        raise ValueError("fla Attention under context parallelism takes no mask or cache")
    packed = hidden_states.shape
    if cu_seqlens is not None:
        if layout.local_document_positions is None:
            raise ValueError("fla Attention under context parallelism takes cu_seqlens only with the step's documents")
        hidden_states = hidden_states.reshape(*layout.positions.shape, -1)
    B, T, _ = hidden_states.shape
    q, k, v = (proj(hidden_states).unflatten(-1, (-1, self.head_dim)) for proj in (self.q_proj, self.k_proj, self.v_proj))
    if self.qk_norm:
        q, k = self.q_norm(q), self.k_norm(k)
    positions = layout.positions if layout.local_document_positions is None else layout.local_document_positions
    length = max(T * layout.world, self.max_position_embeddings or 0)  # positions of the whole sequence
    cos, sin = compat.fla_rotary_tables(self.rotary, length, q)
    q, k = rotate_at(q, cos, sin, positions, self.rotary.interleaved), rotate_at(k, cos, sin, positions, self.rotary.interleaved)
    o = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window=self.window_size)
    o = self.o_proj(o.transpose(1, 2).reshape(B, T, -1))
    return o.reshape(*packed[:-1], -1), None, past_key_values
