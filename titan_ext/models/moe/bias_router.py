"""torchtitan's auxiliary-loss-free balancing on transformers' softmax top-k routers (``moe_balance = "bias"``):
the router's own forward with a per-expert bias in its top-k choice, and the optimizer pre-hook that moves the
bias. The biased router is what the model holds, so it lives with the model, whatever parallelizes it.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titan_ext import compat
from titan_ext.models.moe.blocks import moe_layer_indices, routers
from titan_ext.models.moe.records import RECORDS


ROUTER_FIELDS = ("weight", "hidden_dim", "num_experts", "top_k", "norm_topk_prob")
"""What the biased router reads of transformers' router (Qwen2/3-MoE's, Qwen3-Next's, OLMoE's; not Mixtral's)."""


BIAS_RATE = 1e-3
"""How far one optimizer step moves an expert's routing bias (torchtitan's default ``load_balance_coeff``)."""


def apply_expert_bias(model: nn.Module) -> None:
    """torchtitan's auxiliary-loss-free balancing (arXiv 2408.15664) on transformers' routers: a per-expert
    ``expert_bias`` (a buffer saved in checkpoints) added to the router's probabilities to choose the top-k
    experts only (the chosen experts' weights are the unbiased probabilities), and the tokens each expert got
    since the last optimizer step (``tokens_per_expert``), which ``update_expert_bias`` turns into the bias."""
    for router in routers(model):
        bias_router(router)


def bias_router(gate: nn.Module) -> nn.Module:
    """One router, biased in place (a zero bias: it routes as before)."""
    gate.register_buffer("expert_bias", torch.zeros(gate.num_experts, device=gate.weight.device))
    gate.register_buffer("tokens_per_expert", torch.zeros(gate.num_experts, device=gate.weight.device),
                         persistent=False)
    gate.__class__ = _biased_router_class(type(gate))
    return gate


@functools.cache
def _biased_router_class(cls: type) -> type:
    return type(f"Biased{cls.__name__}", (cls,), {"forward": _biased_router_forward,
                                                   "init_titan_ext_buffers": _zero_expert_bias})


def _zero_expert_bias(self) -> None:
    with torch.no_grad():
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()


def _biased_router_forward(self, hidden_states):
    """``(router_logits, top_k_weights, top_k_index)`` as transformers' softmax routers return them, the top-k
    chosen on the probabilities plus ``expert_bias``."""
    weight = self.weight
    if isinstance(hidden_states, DTensor):  # under TP (model_plans' router): replicated, computed locally
        hidden_states, weight = hidden_states.to_local(), weight.to_local()
    logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), weight)
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    index = (probs + self.expert_bias).topk(self.top_k, dim=-1).indices
    weights = probs.gather(-1, index)
    if self.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    # training forwards only: not validation, nor a recompute in backward (activation checkpointing), nor torch's
    # pipeline metadata inference (``RouterRecords.live``)
    if torch.is_grad_enabled() and not compat.in_backward() and RECORDS.live:
        with torch.no_grad():
            self.tokens_per_expert += torch.bincount(index.flatten(), minlength=self.num_experts)
    return logits, weights.to(logits.dtype), index


def update_expert_bias(model_parts: list[nn.Module], group: dist.ProcessGroup | None) -> None:
    """After a step's forwards and before its update (torchtitan's optimizer pre-hook, so once per step with
    gradient accumulation): each router's bias moves ``BIAS_RATE`` toward its under-used experts and away from
    its over-used ones (centered), from the tokens each expert got over the global batch (summed over
    ``group``, the batch's ranks): the same bias on every rank. Under PP ``model_parts`` are this rank's
    stages: each router's counts are its own stage's, over all the step's microbatches."""
    biased = [router for part in model_parts for router in routers(part)]
    if not biased:
        return
    counts = torch.stack([router.tokens_per_expert for router in biased])  # [MoE layers here, experts]
    slots = [RECORDS.choice.moe_layers.index(i) for part in model_parts for i in moe_layer_indices(part)]
    RECORDS.add_step(counts.new_zeros(()), counts.new_zeros(()), counts, slots)  # summed over the ranks when logged
    if group is not None and dist.is_initialized():
        dist.all_reduce(counts, group=group)
    with torch.no_grad():
        for router, count in zip(biased, counts):
            delta = BIAS_RATE * torch.sign(count.mean() - count)
            router.expert_bias += delta - delta.mean()
            router.tokens_per_expert.zero_()


def tokens_counted(model_parts: list[nn.Module], counts: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The biased routers' token counts since the last update (none without the routing bias); given ``counts``
    (an earlier return), they are set back to those (the pipeline's warm-up step on gloo counts for no step)."""
    biased = [router for part in model_parts for router in routers(part) if hasattr(router, "expert_bias")]
    with torch.no_grad():
        for router, count in zip(biased, counts or ()):
            router.tokens_per_expert.copy_(count)
    return [router.tokens_per_expert.clone() for router in biased]


def with_expert_bias_update(build_optimizers):
    """Wrap a train spec's ``build_optimizers_fn``: with ``moe_balance = "bias"`` the optimizers update the
    routers' biases before each step."""

    @functools.wraps(build_optimizers)
    def build(model_parts, optimizer_config, parallel_dims, *args, **kwargs):
        from titan_ext.job_plan import job_plan_of

        optimizers = build_optimizers(model_parts, optimizer_config, parallel_dims, *args, **kwargs)
        choice = job_plan_of(model_parts[0]).moe
        if choice is not None and choice.balance == "bias":
            batch_mesh = parallel_dims.get_optional_mesh("loss")
            group = batch_mesh.get_group() if batch_mesh is not None else None
            optimizers.register_step_pre_hook(lambda *_, **__: update_expert_bias(model_parts, group))
        return optimizers

    return build
