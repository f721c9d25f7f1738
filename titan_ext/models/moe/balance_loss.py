"""The routers' load-balancing loss as the model was trained with it, added to the job's loss.

transformers' causal LMs add ``router_aux_loss_coef`` x the Switch Transformer balancing loss only when asked
for router logits and given labels, which torchtitan never does (it computes the loss from the logits). Here
the loss adds the balancing term from the routers' records (``with_balance_loss``).

The term is counted per token, as torchtitan's cross entropy is (a sum the trainer divides by the global
count of valid tokens): over one sequence the model's own formula (``load_balancing_loss_func`` with the
valid labels as its mask: expert shares and mean router probabilities over all MoE layers), weighted by the
sequence's valid tokens. A sequence's term needs nothing from other sequences, so the loss is the same under
FSDP/HSDP/DDP and with gradient accumulation; for one sequence per batch it is the model's own loss exactly.
Under CP each rank holds pieces of every sequence: the ranks sum each sequence's expert assignments and valid
tokens (no gradient flows through them), and each rank's term is its own tokens' share of the probability
sum, which is linear, so the ranks' terms add up to the whole sequence's loss and its gradient, as the cross
entropy's do. Under PP the earlier stages' statistics reach the loss with the hidden states
(``titan_ext.models.moe.records``).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_ext.models.moe.records import RECORDS, routed_statistics


IGNORE_INDEX = -100


def balance_loss_sum(router_logits: list[torch.Tensor], labels: torch.Tensor, num_experts: int, top_k: int,
                     cp_group: dist.ProcessGroup | None = None, layers: int | None = None,
                     carried: torch.Tensor | None = None):
    """(sum over sequences of valid tokens x the model's balancing loss of that sequence, per-(layer, expert)
    routed-token counts of ``router_logits``), of this rank's tokens.

    ``router_logits``: per MoE layer ``[batch * seq, experts]``; ``labels``: ``[batch, seq]``. Per sequence,
    ``E * sum_e f_e * P_e`` with ``f_e`` the share of top-k assignments to expert e and ``P_e`` the mean
    router probability, both over the sequence's valid tokens and all ``layers`` MoE layers (default: those
    of ``router_logits``; under PP the earlier stages' come as ``carried``, ``routed_statistics`` summed).
    Under CP (``cp_group``) ``labels`` hold this rank's pieces of the sequences: ``f_e`` and the valid tokens
    are summed over the CP ranks, and the result is this rank's tokens' part of the loss (the parts add up to
    it, and so do their gradients: the loss is linear in the probabilities).
    """
    batch, seq = labels.shape
    valid = (labels != IGNORE_INDEX).to(torch.float32)  # [B, S]
    layers = layers or len(router_logits)
    statistics, counts = routed_statistics(router_logits, num_experts, top_k, (batch, seq), labels.device)
    if carried is not None:
        statistics = statistics.to(carried.device) + carried
    probs_sum, chosen = statistics.split(num_experts, dim=-1)
    assigned = (chosen.detach() * valid[..., None]).sum(1)  # valid top-k assignments per sequence
    sequence = torch.cat([assigned, valid.sum(-1, keepdim=True)], dim=-1)  # [B, E + 1]: no gradient
    if cp_group is not None:
        dist.all_reduce(sequence, group=cp_group)  # the whole sequences' assignments and valid tokens
    assigned, tokens = sequence.split([num_experts, 1], dim=-1)
    share = assigned / (layers * tokens.clamp_min(1))  # [B, E]
    loss = num_experts * (valid[..., None] * share[:, None, :] * probs_sum / layers).sum()
    return loss, counts


def with_balance_loss(build_loss_fn):
    """Wrap a train spec's ``build_loss_fn``: the built loss adds ``router_aux_loss_coef`` x the balancing
    term (a per-token sum, as the cross entropy is) of the model's forward before it."""

    @functools.wraps(build_loss_fn)
    def build(job_config, **kwargs):
        loss_fn = build_loss_fn(job_config, **kwargs)

        def loss_with_balance(pred, labels):
            loss = loss_fn(pred, labels)
            taken, choice = RECORDS.take(), RECORDS.choice
            if taken is None or choice is None:
                return loss
            logits, carried, slots = taken
            balance, counts = balance_loss_sum(logits, labels, choice.num_experts, choice.top_k, RECORDS.cp_group,
                                               len(choice.moe_layers), carried)
            if torch.is_grad_enabled():  # training, not validation: this step's metrics
                RECORDS.add_step(balance, (labels != IGNORE_INDEX).sum(), counts, slots)
            if not choice.aux_loss_coef:
                return loss
            balance = choice.aux_loss_coef * balance.to(loss.dtype)
            if isinstance(loss, DTensor):  # loss parallel: a replicated loss, as the balancing term is on each TP rank
                balance = DTensor.from_local(balance, loss.device_mesh, loss.placements, run_check=False)
            return loss + balance

        return loss_with_balance

    return build
