"""Pipeline parallelism for HF-layout models at run time: the train specs' ``pipelining_fn``.

torchtitan's ``pipeline_llm`` splits a model by its own top-level names
(``tok_embeddings``, ``layers.N``, ``norm``, ``output``) and re-indexes a
``ModuleList``. titan_ext's models nest HF names (``model.layers.N``) and must
keep them, so checkpoints (DCP and HF) mean the same tensors with and without
PP. Here each stage is a copy of the meta-device model holding its blocks under
their original indices (``StageLayers``), as the plan chose them
(``titan_ext.parallel.pipeline_plan``); the embedding, final norm and head
exist only on the stages that run them, and the adapter's forward takes hidden
states where the embedding is gone and returns them where the head is
(``titan_ext.models.adapter``). torchtitan's ``build_pipeline_schedule`` runs
any of its schedules over them. A head tied to the embedding has a copy of the
weight on the first and on the last stage, kept equal (``TiedWeight``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage

from titan_ext.job_plan import PPChoice, job_plan_of
from titan_ext.models.moe.bias_router import tokens_counted
from titan_ext.models.moe.records import RECORDS
from titan_ext.parallel import host_patches
from titan_ext.parallel.pipeline_plan import model_parts_of
from titan_ext.patching import apply_once

logger = logging.getLogger()


class StageLayers(nn.Module):
    """One stage's blocks under their original indices, so parameter names stay the whole model's.

    Iterates and slices like the ``ModuleList`` it replaces (HF decoders loop
    over ``self.layers[: num_hidden_layers]``).
    """

    def __init__(self, blocks: dict[str, nn.Module]):
        super().__init__()
        for name, block in blocks.items():
            self.register_module(name, block)

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, index):
        return list(self._modules.values())[index]


def stage_model(whole: nn.Module, modules: tuple[str, ...]) -> nn.Module:
    """A copy of ``whole`` (meta device) holding only ``modules``: the others are gone (None, or an
    Identity for the final norm, which HF decoders always call).

    A tied head's stage also keeps the embedding module, unused, as the owner of the weight the head
    shares: the stage's parameters, state dict and optimizer state then name that weight as one process
    names it (``model.embed_tokens.weight``), so checkpoints hold it once at every PP degree, and TP
    shards it as in one process (``model_plans.apply.retie_embeddings``)."""
    embeddings, layers, norm, head = model_parts_of(whole)
    keep = set(modules)
    # the blocks the stage drops are not copied (each copied and dropped was most of a stage's build)
    memo = {id(block): block for name, block in whole.get_submodule(layers).named_children()
            if f"{layers}.{name}" not in keep}
    model = copy.deepcopy(whole, memo)  # a tied head keeps sharing the embedding's weight
    blocks = model.get_submodule(layers)
    kept = {name: block for name, block in blocks.named_children() if f"{layers}.{name}" in keep}
    _replace(model, layers, StageLayers(kept))
    _stage_layer_types(model, [int(name) for name in kept])
    if embeddings not in keep:  # a stage after the first: hidden states in (``Structure.takes_hidden_states``)
        model.structure = dataclasses.replace(model.structure, embeddings=None)
    if embeddings not in keep and not (model.structure.tied and head in keep):
        _replace(model, embeddings, None)
    if norm is not None and norm not in keep:
        _replace(model, norm, nn.Identity())
    if head not in keep:
        _replace(model, head, None)
    return model


def _stage_layer_types(model: nn.Module, indices: list[int]) -> None:
    """A hybrid transformers decoder picks each block's mask by ``config.layer_types[i]``, ``i`` counted in
    the loop over its blocks, which in a stage start at 0: the stage's own copy of the config lists its
    blocks' kinds (the stage is a deep copy: its modules share a config of their own; checkpoints record
    ``model_args``' config, and each block's mixer was read at build: ``model.mixers``)."""
    types = getattr(model.config, "layer_types", None)
    if isinstance(types, list) and len(types) == model.config.num_hidden_layers:
        model.config.layer_types = [types[i] for i in indices]


def _replace(model: nn.Module, fqn: str, module: nn.Module | None) -> None:
    parent, _, name = fqn.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def pipeline_hf_model(model, parallel_dims, job_config, device, model_args, parallelize_fn, loss_fn):
    """torchtitan's ``pipelining_fn``: this rank's stages, each parallelized, and the schedule."""
    from torchtitan.distributed.pipeline_parallel import build_pipeline_schedule

    choice = job_plan_of(model_args).pp
    mesh = parallel_dims.get_mesh("pp")
    stages, parts = [], []
    for index in choice.stage_indices(mesh.get_local_rank()):
        part = parallelize_fn(stage_model(model, choice.stages[index]), parallel_dims, job_config)
        stages.append(MicroBatchStage(part, index, len(choice.stages), device, group=mesh.get_group()))
        parts.append(part)
        logger.info(f"PP: stage {index} of {len(choice.stages)} holds {list(choice.stages[index])}")
    RECORDS.live = False  # until a stage runs a microbatch (MicroBatchStage)
    from titan_ext.cpu_mode import on_gloo

    # the last stage's labels are this rank's piece of its batch: count them over data and context parallel ranks
    loss_mesh = parallel_dims.get_mesh("loss") if parallel_dims.dp_cp_enabled else None
    tied = None
    if model.structure.tied:
        embeddings, _, _, head = model_parts_of(model)
        tied = TiedWeight.of(choice, mesh, stages, parts, (embeddings, head))
        apply_once(host_patches.PIPELINE)
    schedule = TokenMeanSchedule(loss_fn, loss_mesh, parts, warm_up=on_gloo(mesh), accumulation=choice.accumulation,
                                 pp_group=mesh.get_group(), tied=tied)
    schedule.wrap(build_pipeline_schedule(job_config, stages, schedule.loss_fn))
    return schedule, parts, any(s.is_first for s in stages), any(s.is_last for s in stages)


def _rank_of(choice: PPChoice, stage: int) -> int:
    """The pipeline rank running ``stage``."""
    return next(rank for rank in range(choice.degree) if stage in choice.stage_indices(rank))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly FSDP/TP-sharded) tensor, sharing its storage."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class TiedWeight:
    """A tied embedding and head under PP, as Megatron-LM's embedding group: one copy of the weight on each
    stage that uses it (the first stage's embedding, the last stage's head), kept equal.

    The copies start from the first stage's values, and after each optimizer step's last backward every
    copy's gradient becomes the sum of all copies' (one all-reduce over the pipeline ranks holding them, for
    each data/tensor-parallel coordinate; local where one rank holds both stages, as in V-shaped schedules).
    With equal values, equal gradients and the same optimizer the copies stay equal; clipping counts the
    weight once (``host_patches.TIED_COPY``), and checkpoints name it once (the embedding's name on every stage).
    FSDP and TP shard each copy alike (on the vocabulary), so their local shards line up rank for rank.
    """

    def __init__(self, parts: list[nn.Module], group, source: int):
        self.parts, self.group, self.source = parts, group, source
        """This rank's stages holding a copy (the first stage's first, if here), the process group of the ranks
        holding them (None: this rank holds them all), and the global rank holding the first stage's."""
        self.synced = False

    @property
    def copies(self) -> list[nn.Parameter]:
        """Read when used: torchtitan's ``to_empty`` gives the stages new parameters after they are built."""
        return [part.get_input_embeddings().weight for part in self.parts]

    @classmethod
    def of(cls, choice: PPChoice, mesh, stages, parts: list[nn.Module], ends: tuple[str, str]) -> "TiedWeight | None":
        """This rank's copies (None where it holds none); every rank of the job calls it (the subgroups are made
        collectively). ``ends``: the FQNs of the embedding and the head."""
        import torch.distributed as dist

        holding = [index for index, stage in enumerate(choice.stages) if any(name in stage for name in ends)]
        holders = sorted({_rank_of(choice, index) for index in holding})
        mine = [part for stage, part in zip(stages, parts) if stage.stage_index in holding]
        pp_ranks = mesh.mesh.tolist()
        if len(holders) == 1:
            group = None
        elif len(holders) == len(pp_ranks):
            group = mesh.get_group()
        else:  # a subgroup per pipeline: every rank takes part in making every one
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, tuple(pp_ranks[r] for r in holders))
            group, _ = dist.new_subgroups_by_enumeration(sorted(set(every)))
        return cls(mine, group, pp_ranks[holders[0]]) if mine else None

    @torch.no_grad()
    def sync(self) -> None:
        """Every copy takes the first stage's values (torchtitan seeds each pipeline rank differently)."""
        import torch.distributed as dist

        copies = self.copies
        first = _local(copies[0])
        if self.group is not None:
            dist.broadcast(first, src=self.source, group=self.group)
        for copy_ in copies[1:]:
            _local(copy_).copy_(first)
        for part, copy_ in zip(self.parts, copies):
            if part.structure.takes_hidden_states:  # not the first stage's: clipping must not count it again
                setattr(copy_, host_patches.TIED_COPY, True)
        self.synced = True

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Every copy's gradient becomes the sum of all copies' (once per optimizer step)."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        for param in self.copies:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            elif isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
                # TP: the rowwise embedding's gradient comes back replicated; lay it out as the weight (and
                # the other copy) is, so the local shards line up
                param.grad = param.grad.redistribute(param.device_mesh, param.placements)
        grads = [_local(param.grad) for param in self.copies]
        total = torch.stack(grads).sum(0) if len(grads) > 1 else grads[0].clone()
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for grad in grads:
            grad.copy_(total)


class TokenMeanSchedule:
    """A torchtitan pipeline schedule whose backward sees the loss over the global valid tokens.

    torchtitan 0.2.2's non-PP step backpropagates ``loss sum / global valid
    tokens``; its PP step backpropagates each microbatch's loss SUM and divides
    only the logged loss, so gradients (and what gradient clipping sees) grow
    with the token count. Here the last stage divides each microbatch's loss by
    the step's global valid-token count (its labels, summed over the
    data-parallel ranks and, under CP, the context-parallel ones: each holds a
    piece of every row), and multiplies the losses it hands back so torchtitan's
    own division logs the same number.

    With gradient accumulation torchtitan runs the schedule once per accumulated batch, and the count
    that matters is the whole optimizer step's, which no single schedule step sees: each one divides by
    the first batch's count instead, and after the last one every stage multiplies its gradients by
    (first count / step's count), agreed over the pipeline ranks (one scalar all-reduce per optimizer
    step), before torchtitan clips them. Then (or after each step without accumulation) the tied
    weight's copies sum their gradients (``TiedWeight``): once per optimizer step, after its last backward.

    On gloo, torch 2.13's schedules feed the first microbatch of their first
    step from a receive buffer the data has not reached (uninitialized values,
    e.g. 1e30; reproduced with two ``nn.Linear`` stages). That first step runs
    once as a warm-up with a zero loss and its gradients are dropped, so the
    real first step starts from initialized buffers.
    """

    def __init__(self, loss_fn, loss_mesh, parts: list[nn.Module], warm_up: bool, accumulation: int = 1,
                 pp_group=None, tied: TiedWeight | None = None):
        self._loss_fn, self._loss_mesh, self._parts, self._tied = loss_fn, loss_mesh, parts, tied
        self._schedule = None
        self._tokens: torch.Tensor | None = None
        """What this optimizer step's microbatch losses are divided by (the last stage's; None in validation)."""
        self._warm_up = self._on_gloo = warm_up
        self._warming_up = False
        self._accumulation, self._pp_group = accumulation, pp_group
        self._calls, self._step_tokens = 0, None

    def wrap(self, schedule) -> None:
        self._schedule = schedule

    def loss_fn(self, pred, labels):
        if self._warming_up:
            RECORDS.take()  # what the forward left for the MoE balancing loss, dropped with the loss
            return pred.sum() * 0  # a loss for the schedule's backward, kept from the non-finite guard
        if self._tokens is None:  # validation: the sum, as the validator expects
            return self._loss_fn(pred, labels)
        return self._loss_fn(pred, labels) / self._tokens

    def step(self, *args, target=None, losses=None, **kwargs):
        if target is not None:  # the last stage
            from torchtitan.components.loss import IGNORE_INDEX
            from torchtitan.distributed import utils as dist_utils

            tokens = (target != IGNORE_INDEX).sum()
            tokens = dist_utils.dist_sum(tokens, self._loss_mesh) if self._loss_mesh is not None else tokens.float()
            if self._calls == 0:  # the first batch of an optimizer step sets the divisor
                self._tokens, self._step_tokens = tokens, 0.0
            self._step_tokens += float(tokens)
        if self._tied is not None and not self._tied.synced:  # after any checkpoint load, before training
            self._tied.sync()
        if self._warm_up:  # once, on gloo: see the class docstring
            self._warm_up, self._warming_up = False, True
            routing = RECORDS.stats  # a MoE model's routing counts: the warm-up's are not a step's
            counted = tokens_counted(self._parts)
            self._schedule.step(*args, target=target, losses=[] if losses is not None else None, **kwargs)
            self._warming_up, RECORDS.stats = False, routing
            tokens_counted(self._parts, counted)
            for part in self._parts:
                part.zero_grad(set_to_none=True)
        result = self._schedule.step(*args, target=target, losses=losses, **kwargs)
        if losses is not None:
            losses[:] = [loss * self._tokens for loss in losses]
        self._calls += 1
        if self._calls == self._accumulation:  # the optimizer step's last backward is done
            if self._accumulation > 1:
                self._rescale_gradients()
            if self._tied is not None:  # once per optimizer step: summing after each batch would add twice
                self._tied.sum_gradients()
            self._calls = 0
        return result

    def _rescale_gradients(self) -> None:
        """Gradients of the accumulated batches, each divided by the first batch's count: to the step's count."""
        import torch.distributed as dist

        factor = float(self._tokens) / self._step_tokens if self._step_tokens else 0.0  # the last stage's
        device = next((p.device for part in self._parts for p in part.parameters()), torch.device("cpu"))
        agreed = torch.tensor([factor], dtype=torch.float64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self._pp_group)  # stages without the loss add 0
        for part in self._parts:
            for param in part.parameters():
                if param.grad is not None:
                    param.grad.mul_(agreed.item())

    def eval(self, *args, **kwargs):
        """A forward-only pass (``titan_ext.host.validate``): each microbatch's loss sum in ``losses``.

        On gloo the next training step reads an unfilled receive buffer again (as the first one
        does): it warms up again."""
        self._tokens = None
        self._warm_up = self._on_gloo
        if self._tied is not None and not self._tied.synced:
            self._tied.sync()
        return self._schedule.eval(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._schedule, name)


class MicroBatchStage(PipelineStage):
    """A ``PipelineStage`` that tells its model's context-parallel layout which micro-batch it runs.

    Under CP the bound mixers read each forward's positions and document boundaries from the model's
    ``PieceLayout``, recorded when the stage's forward starts (the schedule hands every stage its
    micro-batch's slice of torchtitan's kwargs). A stage runs several forwards before their backwards,
    and activation checkpointing recomputes blocks inside a backward: the layout keeps one record per
    micro-batch, and the stage selects it before each forward and backward (``PieceLayout.micro_batch``).
    Without CP it is torch's stage. For a MoE model it also marks the forwards of micro-batches as the ones
    its routers record and count (``RouterRecords.live``, ``titan_ext.models.moe.records``), not torch's
    metadata inference.
    """

    def _select(self, index: int) -> None:
        layout = self.submod.forward_plan.cp_layout
        if layout is not None:
            layout.micro_batch(index)

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        self._select(fwd_chunk_id)
        RECORDS.live = True  # a MoE model's routers record this forward, not torch's metadata inference
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            RECORDS.live = False

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        self._select(bwd_chunk_id)
        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        self._select(bwd_chunk_id)
        return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
