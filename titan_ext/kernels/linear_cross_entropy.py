"""The output head and the cross-entropy over chunks of tokens: no more than one chunk's logits at a time.

``linear_cross_entropy_sum(hidden, weight, labels)`` equals
``F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum", ignore_index=-100)`` (torchtitan's
loss over the head's logits) to fp32 rounding, forward and backward. The forward keeps each token's
log-sum-exp (``[N]`` floats); the backward recomputes each chunk's logits from it, so the ``[N, vocab]``
logits and their gradient never exist whole: one chunk's, in fp32, at most (one more head matmul per chunk).

Under tensor parallelism the head's weight is sharded on the vocabulary (``Shard(0)``): each rank computes
its vocabulary slice's logits, and the log-sum-exp and the label's logit are combined over the TP group
(two all-reduces of ``[N]`` floats per forward); the hidden states' gradient is each rank's partial sum,
which DTensor reduces (``tp_linear_cross_entropy_sum``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate

IGNORE_INDEX = -100
CHUNK_ELEMENTS = 1 << 25
"""With ``chunk_tokens=0``: as many tokens per chunk as keep one chunk's fp32 logits within 128 MiB."""


def chunk_size(chunk_tokens: int, local_vocab: int) -> int:
    return chunk_tokens if chunk_tokens > 0 else max(1, CHUNK_ELEMENTS // max(1, local_vocab))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, vocab_offset, group):
        lse, picked = _token_statistics(hidden, weight, labels, chunk, vocab_offset)
        if group is not None:
            lse, picked = _combine_over_vocabulary(lse, picked, group)
        valid = labels != IGNORE_INDEX
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk, ctx.vocab_offset = chunk, vocab_offset
        return torch.where(valid, lse - picked, 0.0).sum()

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, labels, lse = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        # low-precision weights: chunk gradients add up in fp32, as one matmul over all tokens accumulates
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        scale = grad_loss.float() * (labels != IGNORE_INDEX)
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            grad_logits = _chunk_logits(hidden[rows], weight).sub_(lse[rows, None]).exp_()  # softmax
            local, inside = _local_labels(labels[rows], ctx.vocab_offset, weight.shape[0])
            grad_logits.scatter_add_(1, local[:, None], -inside.to(grad_logits.dtype)[:, None])  # - one-hot
            grad_logits = grad_logits.mul_(scale[rows, None]).to(hidden.dtype)
            if want_hidden:
                grad_hidden[rows] = grad_logits @ weight
            if want_weight:
                grad_weight.add_(grad_logits.t() @ hidden[rows])
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A chunk's logits in fp32, rounded from the head's dtype as torchtitan's ``pred.float()`` rounds them."""
    return F.linear(hidden, weight).float()


def _local_labels(labels: torch.Tensor, vocab_offset: int, local_vocab: int):
    """Each label's column in this rank's vocabulary slice, and whether it falls in the slice."""
    local = labels - vocab_offset
    inside = (labels != IGNORE_INDEX) & (local >= 0) & (local < local_vocab)
    return local.clamp(0, max(local_vocab - 1, 0)), inside


@torch.no_grad()
def _token_statistics(hidden, weight, labels, chunk: int, vocab_offset: int):
    """Per token (fp32): the log-sum-exp of its logits over this rank's vocabulary, and its label's logit
    (0 where the label is ignored or outside this rank's slice)."""
    n = hidden.shape[0]
    lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
    picked = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    for start in range(0, n, chunk):
        rows = slice(start, start + chunk)
        logits = _chunk_logits(hidden[rows], weight)
        lse[rows] = logits.logsumexp(-1)
        local, inside = _local_labels(labels[rows], vocab_offset, weight.shape[0])
        picked[rows] = torch.where(inside, logits.gather(1, local[:, None]).squeeze(1), 0.0)
    return lse, picked


def _combine_over_vocabulary(lse: torch.Tensor, picked: torch.Tensor, group):
    """The whole vocabulary's log-sum-exp from each rank's slice's, and the label's logit from the one rank
    holding it."""
    top = lse.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    sums = torch.stack([(lse - top).exp(), picked])
    dist.all_reduce(sums, group=group)
    return top + sums[0].log(), sums[1]


def linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 0,
    vocab_offset: int = 0, group=None,
) -> torch.Tensor:
    """The summed cross-entropy of ``hidden @ weight.T`` against ``labels`` (``-100``: ignored), in chunks.

    ``hidden``: ``[..., D]``; ``labels``: its leading shape. ``weight``: ``[V, D]``, or this rank's rows
    ``[vocab_offset, vocab_offset + V_local)`` of a vocabulary sharded over ``group``.
    """
    flat = hidden.reshape(-1, hidden.shape[-1])
    chunk = chunk_size(chunk_tokens, weight.shape[0])
    return _LinearCrossEntropy.apply(flat, weight, labels.reshape(-1), chunk, vocab_offset, group)


def tp_linear_cross_entropy_sum(hidden, weight, labels: torch.Tensor, chunk_tokens: int = 0) -> torch.Tensor:
    """``linear_cross_entropy_sum`` for a head whose weight may be a TP-sharded DTensor (``Shard(0)``, the
    vocabulary) and whose input a DTensor (sequence parallel) or a plain tensor replicated over the TP ranks.

    Every TP rank needs all tokens' hidden states (an all-gather under sequence parallel); their gradient is
    this rank's partial sum over its vocabulary slice, reduced by DTensor (a reduce-scatter under sequence
    parallel, else an all-reduce).
    """
    if not isinstance(weight, DTensor):
        if isinstance(hidden, DTensor):
            hidden = hidden.full_tensor()
        return linear_cross_entropy_sum(hidden, weight, labels, chunk_tokens)
    mesh = weight.device_mesh
    if mesh.ndim != 1 or not weight.placements[0].is_shard(0):
        raise ValueError(f"the head's weight is laid out as {weight.placements}: the chunked loss needs Shard(0)")
    size, rank = mesh.size(), mesh.get_local_rank()
    vocab = weight.shape[0]
    vocab_offset = min(rank * -(-vocab // size), vocab)  # DTensor's Shard: torch.chunk's split
    return linear_cross_entropy_sum(
        _replicated_local(hidden, mesh), weight.to_local(), labels, chunk_tokens, vocab_offset, mesh.get_group()
    )


def _replicated_local(hidden, mesh) -> torch.Tensor:
    """All of ``hidden`` on this rank, whose gradient is a partial sum over the mesh."""
    if not isinstance(hidden, DTensor):
        hidden = DTensor.from_local(hidden, mesh, (Replicate(),), run_check=False)
    return hidden.redistribute(mesh, (Replicate(),)).to_local(grad_placements=(Partial(),))
