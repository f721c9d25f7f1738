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
    kind = type(model.model_args).cp_attention
    if kind == "transformers":
        _apply_gathered_attention(model, group)
    elif kind == "fla":
        _apply_fla_gathered_attention(model, group)
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

    interface = _OneAttention(gathered_kv_attention(group))
    for block in model.get_decoder().layers:
        owner = type(block.self_attn).forward.__globals__["__name__"]  # the modeling file's registry
        binding.bind(block.self_attn, {}, key=f"context_parallel:{group.group_name}:attention",
                     names={owner: {"ALL_ATTENTION_FUNCTIONS": interface}})
    logger.info(f"Applied context parallelism ({group.size()} ranks): attention over all-gathered keys and values")


class _OneAttention:
    """Stands in for transformers' attention registry inside the bound attention modules."""

    def __init__(self, fn):
        self.fn = fn

    def get_interface(self, name, default):
        return self.fn


def gathered_sdpa(query, key, value, positions, group, scale=None, window: int | None = None, dropout=0.0):
    """Causal attention of this rank's queries over every rank's keys and values (``[B, H, T, D]``;
    ``positions`` ``[B, T]``: each local token's place in the whole sequence). K, V and the positions
    are all-gathered differentiably; the mask compares positions, so any piece layout is exact."""
    import torch.nn.functional as F

    from titan_ext import compat

    keys = compat.all_gather_autograd(key.contiguous(), group, dim=2)
    values = compat.all_gather_autograd(value.contiguous(), group, dim=2)
    key_positions = compat.all_gather_autograd(positions.contiguous(), group, dim=1)[:, None, None, :]
    query_positions = positions[:, None, :, None]
    mask = key_positions <= query_positions
    if window is not None:  # the ``window`` keys up to and including the query
        mask = mask & (query_positions - key_positions < window)
    return F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=query.shape[1] != keys.shape[1]
    )


def gathered_kv_attention(group):
    """A transformers attention function (``[B, H, T, D]`` in, ``[B, T, H, D]`` out) over ``group``'s pieces."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, position_ids=None, **kwargs):
        if position_ids is None:
            raise ValueError("context-parallel attention needs the tokens' global positions (position_ids)")
        out = gathered_sdpa(query, key, value, position_ids, group, scale=scaling, dropout=dropout)
        return out.transpose(1, 2).contiguous(), None

    return attention


def _apply_fla_gathered_attention(model: nn.Module, group) -> None:
    """fla's softmax ``Attention``: its forward under CP is titan_ext's ``fla_attention_forward``."""
    from titan_ext.kernels import binding

    def forward(self, *args, **kwargs):
        return fla_attention_forward(self, *args, group=group, **kwargs)

    for block in model.get_decoder().layers:
        binding.bind(block.attn, {type(block.attn).forward: forward}, key=f"context_parallel:{group.group_name}:fla_attention")
    logger.info(f"Applied context parallelism ({group.size()} ranks): attention over all-gathered keys and values")


def fla_attention_forward(self, hidden_states, attention_mask=None, past_key_values=None, output_attentions=False,
                          use_cache=False, positions=None, group=None, **kwargs):
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
    o = gathered_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), positions, group, window=self.window_size)
    return self.o_proj(o.transpose(1, 2).reshape(B, T, -1)), None, past_key_values


def short_convolutions(mixer: nn.Module) -> list[nn.Module]:
    """fla's ``ShortConvolution`` modules inside ``mixer`` (none when fla is not its library)."""
    if not type(mixer).__module__.startswith("fla."):
        return []
    from fla.modules import ShortConvolution

    return [m for m in mixer.modules() if isinstance(m, ShortConvolution)]
