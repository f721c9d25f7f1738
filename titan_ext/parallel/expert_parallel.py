"""Expert parallelism and the experts' tensor parallelism: the stacked experts' weights placed over the EP
and/or TP ranks, and a forward that sends each token to its experts' ranks and back (all-to-all) or sums the
TP ranks' intermediate shares. Both share one forward (``_expert_parallel_forward``), so they live together.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from titan_ext import compat
from titan_ext.models.moe.blocks import moe_blocks

logger = logging.getLogger()


def apply_ep(model: nn.Module, ep_mesh, tp_mesh=None) -> None:
    """Each rank of ``ep_mesh`` holds ``num_experts / ep`` experts (their stacked weights sharded on dim 0) and
    computes them for every rank's tokens: tokens go to their experts' ranks in one all-to-all and come back in
    another. The parameters keep their names (``mlp.experts.gate_up_proj``), so checkpoints are unchanged.

    Under TP (``tp_mesh``; torchtitan's ETP=1, the EP mesh spanning the TP ranks) every TP rank holds all of
    its batch's tokens (the block gathers them, ``model_plans``' ``moe_block``) and dispatches its share of them
    (a TP rank's slice of the flattened tokens); the block sums the shares."""
    from torch.distributed.tensor import Shard

    for block in moe_blocks(model):
        _place(block.experts, ep_mesh, {"gate_up_proj": [Shard(0)], "down_proj": [Shard(0)]})
        _parallel_experts(block.experts, ep_mesh.get_group(), tp_mesh, split_intermediate=False)
    logger.info(f"Applied expert parallelism (EP={ep_mesh.size()}) to {len(moe_blocks(model))} MoE blocks")


def apply_expert_tp(model: nn.Module, mesh) -> None:
    """torchtitan's TP of the experts: each expert's intermediate dim split over the TP ranks, on the tokens
    every TP rank holds whole (the block gathers them, ``model_plans``' ``moe_block``): ``gate_up_proj``'s gate
    rows and its up rows each split alike (rank r holds gate rows r and up rows r: ``act(gate) * up`` stays
    local), ``down_proj`` split on its input dim, each rank's output a partial sum that the block reduces.

    ``mesh``: the TP mesh (TP without EP), or the ``("ep", "etp")`` mesh (torchtitan's ETP=TP): the experts
    then split over the EP ranks too, each TP rank dispatching all its tokens over its EP group. The packed
    ``[gate; up]`` rows are laid out as a ``_StridedShard`` (the full tensor, checkpoints and HF exports
    unchanged), which DCP cannot describe as one box per rank: ``titan_ext.checkpoints.strided`` gives it its
    boxes."""
    from torch.distributed.tensor import Shard

    from titan_ext.checkpoints import host_patches
    from titan_ext.patching import apply_once

    apply_once(host_patches.STRIDED_CHECKPOINT)

    ep = mesh.ndim == 2
    outer = [Shard(0)] if ep else []
    for block in moe_blocks(model):
        experts = block.experts
        _place(experts, mesh, {"gate_up_proj": [*outer, compat.strided_shard(1, 2)], "down_proj": [*outer, Shard(2)]})
        _parallel_experts(experts, mesh["ep"].get_group() if ep else None, mesh["etp"] if ep else mesh,
                          split_intermediate=True)
    where = f"EP={mesh['ep'].size()} x ETP={mesh['etp'].size()}" if ep else f"TP={mesh.size()}"
    logger.info(f"Split the experts' intermediate dims ({where}) in {len(moe_blocks(model))} MoE blocks")


def _place(experts: nn.Module, mesh, placements: dict) -> None:
    from torch.distributed.tensor import distribute_tensor

    for name, param in list(experts.named_parameters(recurse=False)):
        experts.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, placements[name])))


def _parallel_experts(experts: nn.Module, ep_group, tp_mesh, split_intermediate: bool) -> None:
    experts.__class__ = _expert_parallel_class(type(experts))
    experts.ep_group, experts.tp_mesh, experts.split_intermediate = ep_group, tp_mesh, split_intermediate


@functools.cache
def _expert_parallel_class(cls: type) -> type:
    """The model's experts class with an expert-parallel forward (isinstance checks, e.g. its weight init, hold)."""
    return type(f"ExpertParallel{cls.__name__}", (cls,), {"forward": _expert_parallel_forward})


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return inverse


def _expert_parallel_forward(self, hidden_states, top_k_index, top_k_weights):
    """``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``, as the model's own
    forward computes it, with this rank's experts only; under TP (ETP=1) this TP rank's share of the tokens,
    zeros elsewhere; with the intermediate dims split (``apply_expert_tp``) this TP rank's partial sum."""
    if self.tp_mesh is None:
        return _dispatch_and_combine(self, hidden_states, top_k_index, top_k_weights)
    hidden_states, top_k_weights = (share_gradient(x, self.tp_mesh) for x in (hidden_states, top_k_weights))
    if self.split_intermediate:
        compute = _dispatch_and_combine if self.ep_group is not None else _combine_locally
        return compute(self, hidden_states, top_k_index, top_k_weights)
    rows = torch.arange(hidden_states.shape[0], device=hidden_states.device)
    mine = rows.tensor_split(self.tp_mesh.size())[self.tp_mesh.get_local_rank()]
    out = _dispatch_and_combine(self, hidden_states[mine], top_k_index[mine], top_k_weights[mine])
    return hidden_states.new_zeros(hidden_states.shape).index_copy(0, mine, out)


def share_gradient(x: torch.Tensor, tp_mesh) -> torch.Tensor:
    """``x`` as it is, its gradient summed over ``tp_mesh`` (every TP rank's share, or partial sum, reads it)."""
    return DTensor.from_local(x, tp_mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))


def _dispatch_and_combine(self, hidden_states, top_k_index, top_k_weights):
    group, ep = self.ep_group, dist.get_world_size(self.ep_group)
    gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()  # [E/ep, 2I, H], [E/ep, H, I]
    local = gate_up.shape[0]
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = flat.argsort(stable=True)  # the (token, slot) pairs grouped by expert
    with torch.no_grad():
        sent_counts = torch.bincount(flat, minlength=local * ep)
        received_counts = compat.all_to_all_counts(sent_counts, group).view(ep, local)
        send = sent_counts.view(ep, local).sum(1).tolist()
        receive = received_counts.sum(1).tolist()
        # received rows come per source rank, each grouped by local expert: regroup them by local expert
        local_ids = torch.arange(local, device=flat.device).repeat(ep).repeat_interleave(received_counts.flatten())
        regroup = local_ids.argsort(stable=True)
    routed = compat.all_to_all_autograd(hidden_states[order // k], receive, send, group)[regroup]
    computed = _local_experts(self.act_fn, routed, received_counts.sum(0), gate_up, down)[_inverse(regroup)]
    returned = compat.all_to_all_autograd(computed, send, receive, group)[_inverse(order)]
    weighted = returned.view(*top_k_index.shape, -1) * top_k_weights.unsqueeze(-1)
    return weighted.sum(-2).to(hidden_states.dtype)


def _combine_locally(self, hidden_states, top_k_index, top_k_weights):
    """The model's experts forward on this rank's local weights (every expert; under TP its intermediate share)."""
    gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = flat.argsort(stable=True)  # the (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=gate_up.shape[0])
    computed = _local_experts(self.act_fn, hidden_states[order // k], counts, gate_up, down)[_inverse(order)]
    weighted = computed.view(*top_k_index.shape, -1) * top_k_weights.unsqueeze(-1)
    return weighted.sum(-2).to(hidden_states.dtype)


def _local_experts(act_fn, rows, counts, gate_up, down):
    """``down(act(gate) * up)`` of each local expert on its rows (``rows`` grouped by expert, ``counts`` per
    expert), all experts in one grouped GEMM (``compat.grouped_mm``)."""
    ends = counts.cumsum(0)
    gate, up = compat.grouped_mm(rows, gate_up.transpose(-2, -1), ends).chunk(2, dim=-1)
    return compat.grouped_mm(act_fn(gate) * up, down.transpose(-2, -1), ends)
