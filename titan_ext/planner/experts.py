"""Mixture-of-experts layers on fake tensors, evenly routed.

Which tokens a router sends to which expert is data, and a fake step has none: the model's experts (a loop
over the experts its tokens hit, ``nonzero``) and titan_ext's expert parallelism (``bincount`` and the
exchanged counts) cannot size their tensors. For the step the planner records, each MoE block's experts
module computes as its own forward would if the routing were even: each expert gets an equal share of the
``tokens x top_k`` slots (the load that balanced routing aims at), with the same matmuls per expert and,
under expert parallelism, the same three all-to-alls (the counts, the tokens to their experts' ranks, the
results back) with these sizes. Only ``top_k`` experts' work per token is planned, as the real step does.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titan_ext import compat


def shares(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` as evenly as whole numbers go (the first ones one larger)."""
    return [total // parts + (index < total % parts) for index in range(parts)]


@contextlib.contextmanager
def evenly_routed(model_parts):
    """Every MoE block's experts module in ``model_parts`` computes with even routing inside the block."""
    from titan_ext.models.moe.blocks import moe_blocks

    swapped = [block.experts for part in model_parts for block in moe_blocks(part)]
    for experts in swapped:
        if hasattr(experts, "ep_group"):
            forward = _parallel_forward
        else:  # the model's own experts forward: its loop over the experts, or one of transformers' batched ones
            forward = functools.partial(_forward, looped=_implementation(experts) == "eager")
        experts.forward = types.MethodType(forward, experts)
    try:
        yield
    finally:
        for experts in swapped:
            del experts.forward


def _computed(rows: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor, act_fn) -> torch.Tensor:
    """``down_e(act(gate_e) * up_e)`` of each expert's ``counts[e]`` consecutive rows, as the model's loop
    computes it; with equal counts in one batched matmul per weight (the same bytes and FLOPs, and one
    operator per layer instead of one per expert: a 512-expert model plans in seconds)."""
    if len(set(counts)) == 1:
        batched = rows.view(len(counts), counts[0], rows.shape[-1])
        gate, up = torch.bmm(batched, gate_up.transpose(1, 2)).chunk(2, dim=-1)
        return torch.bmm(act_fn(gate) * up, down.transpose(1, 2)).view(rows.shape[0], -1)
    outputs = []
    for expert, part in enumerate(rows.split(counts)):
        gate, up = F.linear(part, gate_up[expert]).chunk(2, dim=-1)
        outputs.append(F.linear(act_fn(gate) * up, down[expert]))
    return torch.cat(outputs)


def _parallel_forward(self, hidden_states, top_k_index, top_k_weights):
    """``titan_ext.parallel.expert_parallel``'s forward: with each expert's intermediate dim split over TP
    (``split_intermediate``) the inputs' gradients summed over the TP ranks (an all-reduce each in backward) and
    this rank's share of every expert computed on its local weights; with expert parallelism its experts' slots
    exchanged."""
    from titan_ext.parallel.expert_parallel import share_gradient

    if self.split_intermediate:
        hidden_states, top_k_weights = (share_gradient(x, self.tp_mesh) for x in (hidden_states, top_k_weights))
    if self.ep_group is None:
        return _forward(self, hidden_states, top_k_index, top_k_weights)
    return _expert_parallel_forward(self, hidden_states, top_k_index, top_k_weights)


def _implementation(experts) -> str:
    """The experts forward transformers dispatches the module to (``config._experts_implementation``): "eager"
    is the model's loop over the experts, which a model gets when transformers cannot dispatch its experts
    (titan_ext's models get their HF class's dispatch, ``grouped_mm``: ``adapter.titan_class``)."""
    return getattr(getattr(experts, "config", None), "_experts_implementation", None) or "eager"


def _forward(self, hidden_states, top_k_index, top_k_weights, looped: bool = False):
    """transformers' experts loop (``Qwen3MoeExperts.forward``) over every expert, each with its share (of a
    split expert, this rank's local weights).

    ``looped``: the weights taken as the model's loop takes them, one expert's at a time (``gate_up_proj[e]``).
    Each expert's gradient is then as large as the stacked weight (zeros but its slice: ``select_backward``),
    and autograd sums them as backward reaches them, the last expert first: from the second one on it holds
    the sum so far, the next one and their sum, three stacked-weight-sized tensors, the most while the other
    experts' activations are still held. Evenly routed experts are computed in three batched matmuls per
    weight, for the experts before the last two, the last but one, and the last: those sums come at the same
    point of backward. Without it (transformers' grouped GEMM; titan_ext's under TP), in one: a gradient of the
    whole weight."""
    final = torch.zeros_like(hidden_states)
    tokens, k = top_k_index.shape
    with torch.no_grad():  # the model's expert mask (its size counts; its values would pick the rows)
        mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        mask.sum(dim=(-1, -2))
    counts = shares(tokens * k, self.num_experts)
    slots = torch.arange(tokens * k, device=hidden_states.device)  # expert by expert
    token_idx, top_k_pos = slots % tokens, slots // tokens
    gate_up, down = (w.to_local() if isinstance(w, DTensor) else w for w in (self.gate_up_proj, self.down_proj))
    experts = len(counts)
    if looped and experts > 1 and len(set(counts)) == 1:  # (uneven shares: ``_computed`` takes each expert's slice)
        bounds = sorted({0, max(experts - 2, 1), experts - 1, experts})
        groups = [(slice(a, b), slice(a * counts[0], b * counts[0])) for a, b in zip(bounds, bounds[1:])]
    else:
        groups = [(slice(None), slice(None))]
    for chosen, rows in groups:
        taken = (gate_up, down) if len(groups) == 1 else (gate_up[chosen], down[chosen])
        index, position = token_idx[rows], top_k_pos[rows]
        out = _computed(hidden_states[index], counts[chosen], *taken, self.act_fn)
        final.index_add_(0, index, (out * top_k_weights[index, position, None]).to(final.dtype))
    return final


def _expert_parallel_forward(self, hidden_states, top_k_index, top_k_weights):
    """``titan_ext.parallel.expert_parallel``'s expert-parallel forward with the counts even routing gives: every
    rank sends each rank the slots of that rank's experts and receives as many from each."""
    from titan_ext.parallel.expert_parallel import _inverse

    group, ep = self.ep_group, dist.get_world_size(self.ep_group)
    gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()
    local = gate_up.shape[0]
    tokens, k = top_k_index.shape
    per_expert = shares(tokens * k, local * ep)  # each rank's slots per (global) expert
    rank = dist.get_rank(group)
    send = [sum(per_expert[r * local:(r + 1) * local]) for r in range(ep)]
    mine = per_expert[rank * local:(rank + 1) * local]
    receive = [sum(mine)] * ep
    order = top_k_index.reshape(-1).argsort(stable=True)
    with torch.no_grad():
        compat.all_to_all_counts(torch.zeros(local * ep, dtype=torch.long, device=top_k_index.device), group)
        regroup = torch.arange(sum(receive), device=top_k_index.device).argsort(stable=True)
    routed = compat.all_to_all_autograd(hidden_states[order // k], receive, send, group)[regroup]
    computed = _computed(routed, [count * ep for count in mine], gate_up, down, self.act_fn)[_inverse(regroup)]
    returned = compat.all_to_all_autograd(computed, send, receive, group)[_inverse(order)]
    weighted = returned.view(*top_k_index.shape, -1) * top_k_weights.unsqueeze(-1)
    return weighted.sum(-2).to(hidden_states.dtype)
