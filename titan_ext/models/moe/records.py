"""The routers' records: what a forward leaves for its loss, and this step's routing statistics for the metrics.

torchtitan computes the loss from the logits, without the model, so a forward hook on each router keeps its
logits for the balancing loss (``titan_ext.models.moe.balance_loss``). Under PP the loss runs on the last stage:
the stages before it carry their routers' statistics to it with their hidden states, and the gradient comes
back the same way (``apply_router_records``). Under CP the loss counts each sequence's pieces together over the
ranks in ``RECORDS.cp_group``.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titan_ext import compat
from titan_ext.job_plan import MoEChoice
from titan_ext.models.moe.blocks import moe_layer_indices, routers


class RouterRecords:
    """What the loss takes from the forward before it (the last stage's router logits, and the statistics that
    earlier pipeline stages carried), and this step's statistics for the metrics. One per process: torchtitan
    builds the loss without the model."""

    def __init__(self) -> None:
        self.choice: MoEChoice | None = None
        self._cp_group: weakref.ref | None = None
        self.pending: list[tuple[list[torch.Tensor], torch.Tensor | None, list[int]]] = []
        """Per forward of the model's last part: its routers' logits, the carried statistics, its MoE layers' slots."""
        self.live = True
        """Whether a forward now is a real one. Under PP (``titan_ext.parallel.pipeline``) only the schedule's
        forwards of microbatches are: torch 2.13 first runs each stage once for its metadata inference, on
        uninitialized receive buffers, and that forward must neither count its routing nor leave logits for a loss."""
        self.reset_step()

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """The context-parallel ranks holding pieces of the same sequences (None: no CP). Held weakly: the job's
        mesh owns its groups, and a process that runs one job after another (the planner's sweep, the test
        matrix) frees each job's groups, their threads and sockets, with the job."""
        return self._cp_group() if self._cp_group is not None else None

    @cp_group.setter
    def cp_group(self, group: dist.ProcessGroup | None) -> None:
        self._cp_group = weakref.ref(group) if group is not None else None

    def reset_step(self) -> None:
        self.stats: torch.Tensor | None = None
        """[balancing loss sum, valid tokens, routed tokens per (MoE layer of the whole model, expert)...]."""

    def add_step(self, balance: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor,
                 slots: list[int] | None = None) -> None:
        """``counts``: ``[MoE layers here, experts]``; ``slots``: their places among the whole model's MoE
        layers (None: all of them), so that pipeline stages fill disjoint slots of one vector."""
        layers = counts.new_zeros(len(self.choice.moe_layers), self.choice.num_experts, dtype=torch.float64)
        layers[slots if slots is not None else slice(None)] = counts.double()
        stats = torch.cat([balance.detach().double().view(1), tokens.double().view(1), layers.flatten()])
        self.stats = stats if self.stats is None else self.stats + stats

    def take(self) -> tuple[list[torch.Tensor], torch.Tensor | None, list[int]] | None:
        taken, self.pending = self.pending, []
        if len(taken) > 1:  # a forward without its loss: its routing would join another batch's
            raise RuntimeError(
                f"titan_ext: {len(taken)} forwards of a MoE model reached one loss; every forward of a MoE model "
                "must be followed by its loss"
            )
        return taken[0] if taken else None


RECORDS = RouterRecords()


def apply_router_records(model: nn.Module, choice: MoEChoice | None,
                         cp_group: dist.ProcessGroup | None = None) -> None:
    """Keep the routers' logits of each forward of ``model`` (the whole model, or one pipeline stage) for the
    loss (``choice`` from the job plan; None: a dense model; ``cp_group``: the CP ranks, whose pieces of each
    sequence the loss counts together).

    Under PP the loss runs on the last stage, and the balancing loss pools every MoE layer: each stage before
    it adds its routers' per-token statistics (probability sums, with their gradient, and top-k counts) to
    those it received and sends them on with its hidden states (``_stage_end``); the last stage hands its
    routers' logits and the received statistics to the loss. The gradient of the loss then flows back to
    every stage's routers through the same sends, as the hidden states' does. Under sequence parallel each TP
    rank sends the whole sequences' statistics, folded onto its shard of the tokens (``_stage_end``)."""
    for handle in getattr(model, "_router_record_hooks", ()):
        handle.remove()
    RECORDS.__init__()
    RECORDS.choice, RECORDS.cp_group = choice, cp_group
    if choice is None or not choice.record_routers:
        return
    logits: list[torch.Tensor] = []
    carried: list[torch.Tensor] = []
    slots = [choice.moe_layers.index(i) for i in moe_layer_indices(model)]
    hooks = [router.register_forward_hook(functools.partial(_record, logits)) for router in routers(model)]
    structure = getattr(model, "structure", None)  # a plain HF model (its own balancing loss, compared) has none
    if structure is not None and structure.takes_hidden_states:  # a pipeline stage after the first
        hooks.append(model.register_forward_pre_hook(functools.partial(_receive_statistics, choice, carried)))
    hooks.append(model.register_forward_hook(functools.partial(_stage_end, choice, logits, carried, slots)))
    model._router_record_hooks = hooks


def _record(logits: list[torch.Tensor], module, inputs, output) -> None:
    # A block recomputed by activation checkpointing during backward routes again: that is no new forward.
    if not compat.in_backward():
        router_logits = output[0]  # under TP a replicated DTensor (model_plans' router): the same on every TP rank
        logits.append(router_logits.to_local() if isinstance(router_logits, DTensor) else router_logits)


def _statistics_width(num_experts: int, dtype: torch.dtype) -> int:
    """Channels the carried statistics (2 x experts, float32) take beside hidden states of ``dtype``."""
    return 2 * num_experts * 4 // dtype.itemsize if dtype.itemsize < 4 else 2 * num_experts


class _Reinterpret(torch.autograd.Function):
    """The float32 statistics as the bits of a narrower hidden dtype (bf16: 2 channels each), and their
    gradient back the same way: exact, where a cast to bf16 would round the probability sums."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = x.dtype
        return x.contiguous().view(dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous().view(ctx.dtype), None


def _pack(statistics: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return statistics.to(dtype) if dtype.itemsize >= 4 else _Reinterpret.apply(statistics, dtype)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    return packed.float() if packed.dtype.itemsize >= 4 else _Reinterpret.apply(packed, torch.float32)


def _sequence_shards(module) -> int:
    """Under sequence parallel a stage's hidden states cross stages as this TP rank's sequence shard, one of
    this many (``ForwardPlan.residual_layout``); 1 without."""
    layout = module.forward_plan.residual_layout
    return layout[0].size() if layout is not None else 1


def _receive_statistics(choice: MoEChoice, carried: list, module, args):
    """A later stage's input: the previous stage's hidden states, then its statistics' channels (under sequence
    parallel every TP rank's whole sequences' statistics, folded onto its shard of the tokens: ``_stage_end``)."""
    packed = args[0]
    shards = _sequence_shards(module)
    width = shards * _statistics_width(choice.num_experts, packed.dtype)
    batch, tokens = packed.shape[:2]
    carried.append(_unpack(packed[..., -width:]).reshape(batch, tokens * shards, 2 * choice.num_experts))
    return (packed[..., :-width].contiguous(), *args[1:])


def _stage_end(choice: MoEChoice, logits: list, carried: list, slots: list[int], module, args, output):
    """The last part hands its routers' logits (and what it received) to the loss; an earlier stage sends its
    statistics on beside its hidden states."""
    own, received = logits[:], carried.pop() if carried else None
    logits.clear()
    if module.get_output_embeddings() is not None:  # the model's last part: the loss follows
        if RECORDS.live:
            RECORDS.pending.append((own, received, slots))
        return output
    (batch, tokens), shards = output.shape[:2], _sequence_shards(module)
    statistics, counts = routed_statistics(own, choice.num_experts, choice.top_k, (batch, tokens * shards),
                                           output.device)
    if received is not None:
        statistics = statistics + received
    if torch.is_grad_enabled() and RECORDS.live:  # training, not validation: this step's metrics (the routing counts)
        zero = counts.new_zeros(())
        RECORDS.add_step(zero, zero, counts, slots)
    # Under sequence parallel each TP rank sends its shard of the tokens [B, T/tp, D], and the statistics of the
    # whole sequences [B, T, 2E] (the routers saw them gathered; the loss on every TP rank needs them whole, as
    # without PP), folded into as many channels per sent token: [B, T/tp, tp x 2E].
    folded = statistics.reshape(batch, tokens, shards * statistics.shape[-1])
    return torch.cat([output, _pack(folded, output.dtype)], dim=-1)


def routed_statistics(router_logits: list[torch.Tensor], num_experts: int, top_k: int, shape, device) -> tuple:
    """(per token ``[*shape, 2 * experts]``: the router probabilities summed over ``router_logits``' layers,
    then their top-k assignments counted; per layer ``[layers, experts]``: the tokens routed to each expert).
    Only the probabilities carry a gradient."""
    probs_sum, chosen_sum, counts = 0, 0, []  # one layer at a time: no [layers, tokens, E] tensor
    for logits in router_logits:
        probs = F.softmax(logits.float(), dim=-1).view(*shape, num_experts)
        probs_sum = probs_sum + probs
        with torch.no_grad():
            chosen = torch.zeros_like(probs).scatter_(-1, probs.topk(top_k, dim=-1).indices, 1.0)
            chosen_sum = chosen_sum + chosen
            counts.append(chosen.flatten(0, -2).sum(0))
    if not router_logits:  # a pipeline stage without MoE layers
        return torch.zeros(*shape, 2 * num_experts, device=device), torch.zeros(0, num_experts, device=device)
    return torch.cat([probs_sum, chosen_sum], dim=-1), torch.stack(counts)
