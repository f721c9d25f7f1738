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

Softmax attention (``hf_llama``) attends over keys and values all-gathered
from every rank, masked by the tokens' global positions
(``gathered_kv_attention``): exact for either piece layout, and runnable on
CPU, where torch's ring SDPA (CUDA kernels only) is not.

An architecture opts in on its model args: ``cp_kernels`` (a recurrent mixer:
the global names it calls and each one's decay argument) or ``cp_attention``
(the attention registry its attention module reads).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.nn as nn

from titan_ext import documents
from titan_ext.errors import ConfigError

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
    sequence_parallel = not getattr(getattr(job_config, "titan_ext", None), "disable_sequence_parallel", False)
    if tp > 1 and sequence_parallel and (seq_len // degree) % tp:
        raise ConfigError(
            f"--training.seq_len={seq_len}: each rank's {seq_len // degree} tokens ({OPTION}={degree}) do not split "
            f"over --parallelism.tensor_parallel_degree={tp} with sequence parallel on; use a multiple of {degree * tp}"
        )


def apply_cp(model: nn.Module, cp_mesh, choice: CPChoice) -> None:
    """Make each block's mixer see the whole sequence across ``cp_mesh`` (only this model's modules change)."""
    group = cp_mesh.get_group()
    if type(model.model_args).cp_attention:
        _apply_gathered_attention(model, group)
    else:
        _apply_state_passing(model, group, choice)
    model.positions_are_global = True  # torchtitan passes each token's place in the whole sequence


def _apply_state_passing(model: nn.Module, group, choice: CPChoice) -> None:
    from titan_ext.kernels import binding
    from titan_ext.kernels.state_passing import across_ranks, conv_across_ranks

    names = type(model.model_args).cp_kernels
    key = f"context_parallel:{group.group_name}:{choice.pieces_per_rank}"
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


def _apply_gathered_attention(model: nn.Module, group) -> None:
    """Softmax attention: each rank's queries attend to the keys and values of every rank's pieces,
    all-gathered (differentiably) and masked by the tokens' global positions. Exact for any piece
    layout; K and V of the whole sequence are held for the duration of one layer's attention."""
    from titan_ext.kernels import binding

    owner, name = type(model.model_args).cp_attention.split(":")
    interface = _OneAttention(gathered_kv_attention(group))
    for block in model.get_decoder().layers:
        binding.bind(block.self_attn, {}, key=f"context_parallel:{group.group_name}:attention",
                     names={owner: {name: interface}})
    logger.info(f"Applied context parallelism ({group.size()} ranks): attention over all-gathered keys and values")


class _OneAttention:
    """Stands in for transformers' attention registry inside the bound attention modules."""

    def __init__(self, fn):
        self.fn = fn

    def get_interface(self, name, default):
        return self.fn


def gathered_kv_attention(group):
    """A transformers attention function (``[B, H, T, D]`` in, ``[B, T, H, D]`` out) over ``group``'s pieces."""
    import torch
    import torch.nn.functional as F

    from titan_ext import compat

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, position_ids=None, **kwargs):
        if position_ids is None:
            raise ValueError("context-parallel attention needs the tokens' global positions (position_ids)")
        keys = compat.all_gather_autograd(key.contiguous(), group, dim=2)
        values = compat.all_gather_autograd(value.contiguous(), group, dim=2)
        key_positions = compat.all_gather_autograd(position_ids.contiguous(), group, dim=1)
        mask = key_positions[:, None, None, :] <= position_ids[:, None, :, None]  # causal in sequence order
        out = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, dropout_p=dropout, scale=scaling,
            enable_gqa=query.shape[1] != keys.shape[1],
        )
        return out.transpose(1, 2).contiguous(), None

    return attention


def short_convolutions(mixer: nn.Module) -> list[nn.Module]:
    """fla's ``ShortConvolution`` modules inside ``mixer`` (none when fla is not its library)."""
    if not type(mixer).__module__.startswith("fla."):
        return []
    from fla.modules import ShortConvolution

    return [m for m in mixer.modules() if isinstance(m, ShortConvolution)]
