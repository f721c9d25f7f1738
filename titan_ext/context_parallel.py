"""Context parallelism: each rank holds a piece of every sequence, exactly.

torchtitan shards the inputs, labels and positions along the sequence
(``--parallelism.context_parallel_degree``); FSDP then spans the data-parallel
and CP ranks, so each piece's gradients are summed. What its own CP does for
softmax attention (ring SDPA), titan_ext does for linear recurrences: each
token mixer's kernel call runs through ``kernels.state_passing.across_ranks``,
one all-gather of the pieces' states per layer and step (and one of the last
inputs per short convolution), and the result equals one process over the
whole sequence.

With torchtitan's default ``headtail`` load balancer each rank holds two pieces
(``r`` and ``2N-1-r`` of ``2N``); with ``--parallelism.context_parallel_load_balancer
None`` one contiguous piece, which costs a recurrence the same and launches
half the kernels. Both are exact.

Softmax attention (``hf_llama``, the fla transformer) attends over keys and
values all-gathered from every rank (``gathered_sdpa``): exact for either
piece layout, and runnable on CPU, where torch's ring SDPA (CUDA kernels
only) is not.

An architecture opts in (``titan_ext.models.architecture``): ``cp_kernels`` (a recurrent mixer:
the global names it calls and each one's decay argument) or ``cp_attention``
(the attention registry its attention module reads).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch.nn as nn

from titan_ext import documents
from titan_ext.errors import ConfigError
from titan_ext.tensor_parallel import sequence_parallel_enabled

logger = logging.getLogger()

OPTION = "--parallelism.context_parallel_degree"
PIECES_PER_RANK = {None: 1, "headtail": 2}
"""torchtitan's load balancer -> pieces of each sequence per CP rank (``state_passing.piece_order``)."""


@dataclass(frozen=True)
class CPChoice:
    degree: int
    pieces_per_rank: int


def cp_choice(job_config) -> CPChoice | None:
    p = job_config.parallelism
    if p.context_parallel_degree <= 1:
        return None
    return CPChoice(p.context_parallel_degree, PIECES_PER_RANK[p.context_parallel_load_balancer])


def check_cp(model_args, job_config) -> None:
    """CP's preconditions, each a one-line error before the build."""
    p = job_config.parallelism
    degree = p.context_parallel_degree
    if degree <= 1:
        return
    reason = model_args.context_parallel_blocker()
    if reason:
        raise ConfigError(f"{OPTION}={degree}: {reason}")
    if documents.enabled(job_config):
        raise ConfigError(
            f"{OPTION}={degree} with {documents.OPTION}: the state exchange does not yet stop at document "
            "boundaries; turn one of them off"
        )
    balancer = p.context_parallel_load_balancer
    if balancer not in PIECES_PER_RANK:
        raise ConfigError(
            f"--parallelism.context_parallel_load_balancer={balancer!r} reorders tokens in a way a recurrence "
            "cannot follow; use 'headtail' (the default) or None (contiguous pieces)"
        )
    pieces = degree * PIECES_PER_RANK[balancer]
    seq_len = job_config.training.seq_len
    if seq_len % pieces:
        raise ConfigError(
            f"--training.seq_len={seq_len} does not split into {pieces} equal pieces ({OPTION}={degree}"
            f"{', head-tail: 2 per rank' if pieces > degree else ''}); use a multiple of {pieces}"
        )
    tp = p.tensor_parallel_degree
    if tp > 1 and sequence_parallel_enabled(job_config) and (seq_len // degree) % tp:
        raise ConfigError(
            f"--training.seq_len={seq_len}: each rank's {seq_len // degree} tokens ({OPTION}={degree}) do not split "
            f"over --parallelism.tensor_parallel_degree={tp} with sequence parallel on; use a multiple of {degree * tp}"
        )


def apply_cp(model: nn.Module, cp_mesh, choice: CPChoice) -> None:
    """Make each block's mixer see the whole sequence across ``cp_mesh`` (only this model's modules change)."""
    group = cp_mesh.get_group()
    kind = model.arch.cp_attention
    if kind == "transformers":
        _apply_gathered_attention(model, group, choice.pieces_per_rank)
    elif kind == "fla":
        _apply_fla_gathered_attention(model, group, choice.pieces_per_rank)
    else:
        _apply_state_passing(model, group, choice)
    model.positions_are_global = True  # torchtitan passes each token's place in the whole sequence


def _apply_state_passing(model: nn.Module, group, choice: CPChoice) -> None:
    from titan_ext.kernels import binding
    from titan_ext.kernels.state_passing import across_ranks, conv_across_ranks

    names = model.arch.cp_kernels
    key = _binding_key()
    for block in model.get_decoder().layers:
        mixer = block.attn
        scope = type(mixer).forward.__globals__
        replacements = {scope[name]: across_ranks(scope[name], gate, group, choice.pieces_per_rank) for name, gate in names}
        binding.bind(mixer, replacements, key=f"{key}:mixer")
        for conv in short_convolutions(mixer):  # each needs the previous piece's last inputs
            kernel = type(conv).forward.__globals__["causal_conv1d"]
            binding.bind(conv, {kernel: conv_across_ranks(kernel, group, choice.pieces_per_rank)}, key=f"{key}:conv")
    logger.info(
        f"Applied context parallelism ({group.size()} ranks, {choice.pieces_per_rank} piece(s) per rank): "
        f"{', '.join(name for name, _ in names)} pass their states across ranks"
    )


def _apply_gathered_attention(model: nn.Module, group, pieces_per_rank: int) -> None:
    """Softmax attention: each rank's queries attend to the keys and values of every rank's pieces,
    all-gathered (differentiably; ``gathered_sdpa``). K and V of the whole sequence are held for the
    duration of one layer's attention."""
    from titan_ext.kernels import binding

    interface = _OneAttention(gathered_kv_attention(group, pieces_per_rank))
    key = _binding_key()  # one for all blocks: they share one class, so compiled code is shared too
    for block in model.get_decoder().layers:
        owner = type(block.self_attn).forward.__globals__["__name__"]  # the modeling file's registry
        binding.bind(block.self_attn, {}, key=key,
                     names={owner: {"ALL_ATTENTION_FUNCTIONS": interface}})
    logger.info(f"Applied context parallelism ({group.size()} ranks): attention over all-gathered keys and values")


_bindings = itertools.count()


def _binding_key() -> str:
    """A key of its own for each binding: the bound classes hold this job's group and layout (a
    process may run several jobs, and group names repeat once a process group is destroyed)."""
    return f"context_parallel:{next(_bindings)}"


class _OneAttention:
    """Stands in for transformers' attention registry inside the bound attention modules."""

    def __init__(self, fn):
        self.fn = fn

    def get_interface(self, name, default):
        return self.fn


def gathered_sdpa(query, key, value, positions, group, pieces_per_rank: int, scale=None, window: int | None = None,
                  dropout=0.0):
    """Causal attention of this rank's queries over every rank's keys and values (``[B, H, T, D]``).

    K and V are all-gathered differentiably and put in sequence order; each local piece then attends
    to the keys up to its own end with a lower-right causal bias: no mask is built and no later key
    is computed. A sliding ``window`` (fla's ``window_size``) masks by the tokens' global
    ``positions`` (``[B, T]``) instead.
    """
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from titan_ext import compat
    from titan_ext.kernels.state_passing import in_sequence_order, piece_order

    keys = compat.all_gather_autograd(key.contiguous(), group, dim=2)
    values = compat.all_gather_autograd(value.contiguous(), group, dim=2)
    gqa = query.shape[1] != keys.shape[1]
    if window is not None:
        key_positions = compat.all_gather_autograd(positions.contiguous(), group, dim=1)[:, None, None, :]
        query_positions = positions[:, None, :, None]
        mask = (key_positions <= query_positions) & (query_positions - key_positions < window)
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, dropout_p=dropout, scale=scale,
                                              enable_gqa=gqa)
    rank, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    size = query.shape[2] // pieces_per_rank
    if pieces_per_rank > 1:  # gathered in rank order: put the pieces in sequence order
        slots = in_sequence_order(world, pieces_per_rank)
        keys, values = (torch.cat([x.chunk(len(slots), dim=2)[s] for s in slots], dim=2) for x in (keys, values))
    outputs = []
    for query_piece, p in zip(query.chunk(pieces_per_rank, dim=2), piece_order(rank, world, pieces_per_rank)):
        end = (p + 1) * size
        outputs.append(F.scaled_dot_product_attention(
            query_piece, keys[:, :, :end], values[:, :, :end],
            attn_mask=causal_lower_right(size, end), dropout_p=dropout, scale=scale, enable_gqa=gqa,
        ))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def gathered_kv_attention(group, pieces_per_rank: int):
    """A transformers attention function (``[B, H, T, D]`` in, ``[B, T, H, D]`` out) over ``group``'s pieces."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, position_ids=None, **kwargs):
        out = gathered_sdpa(query, key, value, position_ids, group, pieces_per_rank, scale=scaling, dropout=dropout)
        return out.transpose(1, 2).contiguous(), None

    return attention


def _apply_fla_gathered_attention(model: nn.Module, group, pieces_per_rank: int) -> None:
    """fla's softmax ``Attention``: its forward under CP is titan_ext's ``fla_attention_forward``."""
    from titan_ext.kernels import binding

    def forward(self, *args, **kwargs):
        return fla_attention_forward(self, *args, group=group, pieces_per_rank=pieces_per_rank, **kwargs)

    key = _binding_key()
    for block in model.get_decoder().layers:
        binding.bind(block.attn, {type(block.attn).forward: forward}, key=key)
    logger.info(f"Applied context parallelism ({group.size()} ranks): attention over all-gathered keys and values")


def fla_attention_forward(self, hidden_states, attention_mask=None, past_key_values=None, output_attentions=False,
                          use_cache=False, positions=None, group=None, pieces_per_rank=1, **kwargs):
    """fla's ``Attention.forward`` for training under CP: the same projections, qk-norm, rotary
    (at the tokens' global positions) and causal (windowed) attention, over all-gathered K and V."""
    from titan_ext import compat
    from titan_ext.kernels.rotary import rotate_at

    if positions is None or attention_mask is not None or past_key_values is not None or kwargs.get("cu_seqlens") is not None:
        raise ValueError("fla Attention under context parallelism takes global positions only (no mask, cache or cu_seqlens)")
    B, T, _ = hidden_states.shape
    q, k, v = (proj(hidden_states).unflatten(-1, (-1, self.head_dim)) for proj in (self.q_proj, self.k_proj, self.v_proj))
    if self.qk_norm:
        q, k = self.q_norm(q), self.k_norm(k)
    length = max(T * group.size(), self.max_position_embeddings or 0)  # positions of the whole sequence
    cos, sin = compat.fla_rotary_tables(self.rotary, length, q)
    q, k = rotate_at(q, cos, sin, positions, self.rotary.interleaved), rotate_at(k, cos, sin, positions, self.rotary.interleaved)
    o = gathered_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), positions, group, pieces_per_rank,
                      window=self.window_size)
    return self.o_proj(o.transpose(1, 2).reshape(B, T, -1)), None, past_key_values


def short_convolutions(mixer: nn.Module) -> list[nn.Module]:
    """fla's ``ShortConvolution`` modules inside ``mixer`` (none when fla is not its library)."""
    if not type(mixer).__module__.startswith("fla."):
        return []
    from fla.modules import ShortConvolution

    return [m for m in mixer.modules() if isinstance(m, ShortConvolution)]
