"""The job plan as data: ``JobPlan`` and one ``*Choice`` per feature, frozen.

A leaf: it imports nothing of titan_ext, so every feature can read the plan
(and build its own choice) without importing the coordinator that makes it
(``titan_ext.host.job``). The plan reaches its readers on the model args torchtitan
hands them (``job_plan_of``), never through a process-wide global.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPChoice:
    degree: int
    plan_cls: type
    sequence_parallel: bool
    loss_parallel: bool
    float8: bool
    async_tp: bool
    expert_parallel: bool = False
    """MoE experts placed by expert parallelism over the TP ranks' token shares (EP x TP,
    titan_ext.parallel.expert_parallel)."""


@dataclass(frozen=True)
class CPChoice:
    degree: int
    pieces_per_rank: int
    masked_attention: str | None = None
    """What masks softmax attention beyond causality (document masking, a sliding window): it then attends
    over all-gathered keys and values. None: torch's ring attention."""
    rotate_method: str = "allgather"
    """How torch's ring passes keys and values: ``allgather`` (all at once) or ``alltoall`` (rank to rank)."""


@dataclass(frozen=True)
class PPChoice:
    degree: int
    schedule: str
    accumulation: int
    """Schedule steps per optimizer step (``--training.global_batch_size`` over local batch x data-parallel degree)."""
    stages: tuple[tuple[str, ...], ...]
    """Each virtual stage's module FQNs (HF names), in pipeline order."""
    v_shape: bool
    """Stages placed in a V (ZBVZeroBubble, DualPipeV: rank r runs r and its mirror), else looped
    (rank r runs r, r + degree, ...)."""

    def stage_indices(self, rank: int) -> tuple[int, ...]:
        if self.v_shape:
            return rank, len(self.stages) - 1 - rank
        return tuple(range(rank, len(self.stages), self.degree))


@dataclass(frozen=True)
class ACChoice:
    mode: str
    """none, full, selective (every Nth block, or per op), memory_budget."""
    every: int | None
    """selective: checkpoint every Nth block; None means per-op SAC."""
    config: object
    """A copy of torchtitan's [activation_checkpoint] section, for its wrappers."""


@dataclass(frozen=True)
class CompileChoice:
    model: bool
    backend: str


@dataclass(frozen=True)
class Float8Choice:
    filter_fqns: tuple[str, ...]
    high_precision: tuple[str, ...]
    """titan_ext's default filters: linears it keeps in high precision after torchtitan's converter ran."""


@dataclass(frozen=True)
class DataParallelChoice:
    kind: str
    """fsdp, hsdp, ddp or none."""
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    reshard_blocks: bool
    reshard_head: bool
    cpu_offload: bool


@dataclass(frozen=True)
class MoEChoice:
    aux_loss_coef: float
    """``router_aux_loss_coef`` of the model's config: the weight of the routers' balancing loss."""
    num_experts: int
    top_k: int
    ep: int = 1
    """``--parallelism.expert_parallel_degree``: experts split over that many ranks
    (titan_ext.parallel.expert_parallel.apply_ep)."""
    split_intermediate: bool = False
    """Each expert's intermediate dim split over the TP ranks (titan_ext.parallel.expert_parallel.apply_expert_tp): TP
    without EP, or ``expert_tensor_parallel_degree`` equal to the TP degree (torchtitan's ETP=TP)."""
    record_routers: bool = True
    """Router logits kept for the balancing loss and the routing metrics (not with ``balance`` "bias")."""
    balance: str = "aux_loss"
    """``[titan_ext] moe_balance``: "aux_loss" (the router's balancing loss, as the model was trained) or "bias"
    (torchtitan's auxiliary-loss-free balancing: a per-expert routing bias,
    titan_ext.models.moe.bias_router.apply_expert_bias)."""
    moe_layers: tuple[int, ...] = ()
    """The whole model's decoder layers holding a MoE block: the balancing loss pools them, and pipeline stages
    count their tokens per expert in these slots."""


@dataclass(frozen=True)
class LossChoice:
    """The chunked loss (``titan_ext.models.loss``); the plan holds None for torchtitan's loss over the logits."""

    chunk_tokens: int
    """0: automatic (``titan_ext.kernels.linear_cross_entropy.chunk_size``)."""


@dataclass(frozen=True)
class JobPlan:
    world_size: int
    kernel_path: str
    """fla (CUDA: fla's kernels) or portable (torch code); see titan_ext.kernels."""
    tp: TPChoice | None
    cp: CPChoice | None
    pp: PPChoice | None
    ac: ACChoice
    compile: CompileChoice
    float8: Float8Choice | None
    data_parallel: DataParallelChoice
    moe: MoEChoice | None
    """A mixture-of-experts model's routing (titan_ext.parallel.moe_plan); None for a dense model."""
    loss: LossChoice | None
    """None: torchtitan's loss over the model's logits."""
    document_mask: bool
    """``[titan_ext] document_mask``: packed windows train as their documents (``titan_ext.data.documents``)."""
    nonfinite: str
    metrics_jsonl: str
    hf_export: bool
    """--checkpoint.last_save_in_hf: titan_ext completes the folder (config.json, tokenizer)."""
    hf_assets_path: str


def job_plan_of(holder) -> JobPlan:
    """The plan on model args, or on a model built from them (``model.model_args``): what torchtitan hands
    every builder is one of the two."""
    args = getattr(holder, "model_args", holder)
    plan = getattr(args, "plan", None)
    if plan is None:
        raise RuntimeError(
            f"{type(args).__name__} carries no job plan: torchtitan plans a titan_ext job when it calls "
            "update_from_config on the args of a titan_ext train spec, before any builder runs"
        )
    return plan
