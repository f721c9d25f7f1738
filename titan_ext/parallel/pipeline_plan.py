"""Pipeline parallelism at plan time: the stages and the schedule checked and chosen from the meta-device model
(``pp_choice``, ``JobPlan.pp``), before anything is built; the stages are built at run time
(``titan_ext.parallel.pipeline``).

Stages are balanced as torchtitan balances its own (its ``generate_llm_fqn_per_model_part``, with the
embedding and the head weighted as ``pipeline_parallel_first/last_stage_less_layers`` blocks), a hybrid's by
each block's cost (``layer_costs``), or follow ``--parallelism.module_fqns_per_model_part`` in HF names.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
import torch.nn as nn

from titan_ext.errors import ConfigError
from titan_ext.job_plan import PPChoice

DEGREE = "--parallelism.pipeline_parallel_degree"

SCHEDULE = "--parallelism.pipeline_parallel_schedule"


def model_parts_of(model: nn.Module) -> tuple[str, str, str, str]:
    """FQNs of (input embedding, block list, final norm, output head), found in the model."""
    s = model.structure
    return s.embeddings, s.layers, s.final_norm, s.head


def _schedule_class(name: str):
    from torch.distributed.pipelining.schedules import get_schedule_class

    try:
        return get_schedule_class(name)
    except ValueError as error:
        raise ConfigError(f"{SCHEDULE}={name!r}: {error}; pick one of those") from None


def _stages_per_rank(p, num_layers: int, single: bool) -> int:
    """torchtitan's rule: 1 stage per rank for single-stage schedules, 2 for looped ones, unless
    ``pipeline_parallel_layers_per_stage`` sets the count."""
    per_stage = p.pipeline_parallel_layers_per_stage
    if per_stage is None:
        return 1 if single else 2
    option = f"--parallelism.pipeline_parallel_layers_per_stage={per_stage}"
    weights = p.pipeline_parallel_first_stage_less_layers + p.pipeline_parallel_last_stage_less_layers
    stages = math.ceil((num_layers + weights) / per_stage)
    if stages % p.pipeline_parallel_degree:
        raise ConfigError(
            f"{option} makes {stages} stages for {num_layers} blocks (+{weights} for embedding and head), which do not "
            f"divide over {DEGREE}={p.pipeline_parallel_degree}; pick a layers-per-stage that does"
        )
    per_rank = stages // p.pipeline_parallel_degree
    if single != (per_rank == 1):
        need = "exactly 1 stage" if single else "at least 2 stages"
        raise ConfigError(
            f"{option} gives {per_rank} stage(s) per rank, and {SCHEDULE}={p.pipeline_parallel_schedule!r} runs "
            f"{need} per rank; change the layers per stage or the schedule"
        )
    return per_rank


def _balanced_stages(model: nn.Module, p, count: int, seq_len: int) -> list[list[str]]:
    """torchtitan's balancing, in this model's names; a hybrid's by each layer's cost (``_cost_balanced``)."""
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

    embeddings, layers, norm, head = model_parts_of(model)
    num_layers = len(model.blocks())
    if model.structure.hybrid:
        return _cost_balanced(model, p, count, seq_len)
    try:
        generic = generate_llm_fqn_per_model_part(
            count, num_layers, p.pipeline_parallel_first_stage_less_layers, p.pipeline_parallel_last_stage_less_layers
        )
    except ValueError as error:
        raise ConfigError(
            f"{DEGREE}={p.pipeline_parallel_degree} cannot split {num_layers} blocks into {count} stages ({error}); "
            "use fewer stages or a model with more blocks"
        ) from None
    rename = {"tok_embeddings": embeddings, "norm": norm, "output": head}
    stages = [[rename.get(name, name.replace("layers.", f"{layers}.", 1)) for name in stage] for stage in generic]
    return [[name for name in stage if name is not None] for stage in stages]  # no final norm of parameters


def layer_costs(model: nn.Module, seq_len: int) -> list[int]:
    """Training FLOPs per token of each block: 6 per matmul weight plus its token mixer's own
    (``titan_ext.models.mixers``; a hybrid's attention layers cost more than its recurrent ones)."""
    blocks = model.blocks()
    return [6 * sum(p.numel() for p in block.parameters()) + (mixer.flops_per_token(model.config, i, seq_len) or 0)
            for i, (block, mixer) in enumerate(zip(blocks, model.mixers))]


def _cost_balanced(model: nn.Module, p, count: int, seq_len: int) -> list[list[str]]:
    """Contiguous stages of at least one block each whose largest cost is smallest; the embedding and the
    head weigh as many average blocks as torchtitan's ``pipeline_parallel_first/last_stage_less_layers``."""
    embeddings, layers, norm, head = model_parts_of(model)
    costs = layer_costs(model, seq_len)
    n = len(costs)
    if count > n:
        raise ConfigError(f"{DEGREE}={p.pipeline_parallel_degree} cannot split {n} blocks into {count} stages; "
                          "use fewer stages or a model with more blocks")
    mean = sum(costs) / n
    first, last = p.pipeline_parallel_first_stage_less_layers * mean, p.pipeline_parallel_last_stage_less_layers * mean
    prefix = [0, *itertools.accumulate(costs)]

    @functools.cache
    def best(start: int, stages: int) -> tuple[float, tuple[int, ...]]:
        """(largest stage cost, cut points) for blocks ``start:`` in ``stages`` stages."""
        extra = first if start == 0 else 0
        if stages == 1:
            return prefix[n] - prefix[start] + extra + last, ()
        options = []
        for end in range(start + 1, n - stages + 2):
            rest, cuts = best(end, stages - 1)
            options.append((max(prefix[end] - prefix[start] + extra, rest), (end, *cuts)))
        return min(options)

    bounds = [0, *best(0, count)[1], n]
    stages = [[f"{layers}.{i}" for i in range(a, b)] for a, b in zip(bounds, bounds[1:])]
    stages[0].insert(0, embeddings)
    stages[-1] += [name for name in (norm, head) if name is not None]
    return stages


def _check_given_stages(model: nn.Module, stages: list[list[str]]) -> None:
    """``module_fqns_per_model_part``: every part named once, each name a part of this model."""
    embeddings, layers, norm, head = model_parts_of(model)
    parts = [embeddings, *(f"{layers}.{i}" for i in range(len(model.blocks()))), *([norm] if norm else []), head]
    named = [name for stage in stages for name in stage]
    option = "--parallelism.module_fqns_per_model_part"
    for name in named:
        if name not in parts:
            raise ConfigError(f"{option} names {name!r}, which is not a part of this model; its parts are {parts}")
    missing = [name for name in parts if name not in named]
    twice = sorted({name for name in named if named.count(name) > 1})
    if missing or twice:
        raise ConfigError(f"{option} must name every part once: missing {missing}, repeated {twice}")


def pp_choice(model: nn.Module, job_config, world_size: int) -> PPChoice | None:
    """Check PP against the meta-device model and decide the stages (before the build)."""
    p = job_config.parallelism
    if p.pipeline_parallel_degree <= 1:
        return None
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleSingle,
        ScheduleDualPipeV,
        ScheduleZBVZeroBubble,
    )

    schedule = p.pipeline_parallel_schedule
    schedule_class = _schedule_class(schedule)
    training = job_config.training
    batch, micro = training.local_batch_size, p.pipeline_parallel_microbatch_size
    if batch % micro:
        raise ConfigError(
            f"--training.local_batch_size={batch} is not divisible by --parallelism.pipeline_parallel_microbatch_size="
            f"{micro}; pick sizes that divide"
        )
    validation = job_config.validation
    if validation.enable and (validation.local_batch_size != batch or validation.seq_len != training.seq_len):
        raise ConfigError(  # the schedule's microbatches and stage buffers are sized once, for training's batch
            f"--validation.local_batch_size={validation.local_batch_size} and --validation.seq_len={validation.seq_len} "
            f"must equal training's ({batch}, {training.seq_len}) under {DEGREE}={p.pipeline_parallel_degree}; "
            "set them to training's"
        )
    if p.module_fqns_per_model_part:
        stages = [list(stage) for stage in p.module_fqns_per_model_part]
        _check_given_stages(model, stages)
    else:
        per_rank = _stages_per_rank(p, len(model.blocks()), issubclass(schedule_class, PipelineScheduleSingle))
        stages = _balanced_stages(model, p, per_rank * p.pipeline_parallel_degree, training.seq_len)
    if len(stages) % p.pipeline_parallel_degree:
        raise ConfigError(
            f"{len(stages)} pipeline stages do not divide over {DEGREE}={p.pipeline_parallel_degree}; "
            "give a multiple of the degree"
        )
    v_shape = schedule_class in (ScheduleZBVZeroBubble, ScheduleDualPipeV)
    if v_shape and validation.enable:
        raise ConfigError(
            f"--validation.enable with {SCHEDULE}={schedule!r}: torch's forward-only pass of a V-shaped schedule "
            "waits forever for a receive (seen on gloo); validate with another schedule or turn validation off"
        )
    per_rank = len(stages) // p.pipeline_parallel_degree
    if v_shape and per_rank != 2:
        raise ConfigError(f"{SCHEDULE}={schedule!r} runs 2 stages per rank (a V), not {per_rank}; give 2 per rank")
    if schedule_class is ScheduleDualPipeV and p.pipeline_parallel_expert_parallel_overlap and not torch.accelerator.is_available():
        raise ConfigError(
            f"{SCHEDULE}='DualPipeV' with --parallelism.pipeline_parallel_expert_parallel_overlap (torchtitan's "
            "default) needs an accelerator's streams; set --parallelism.no-pipeline_parallel_expert_parallel_overlap "
            "(it overlaps expert-parallel communication, which titan_ext's models do not have)"
        )
    _check_microbatches(schedule, schedule_class, batch // micro, p.pipeline_parallel_degree)
    if schedule_class is ScheduleDualPipeV and batch // micro < len(stages):
        raise ConfigError(
            f"{SCHEDULE}='DualPipeV' needs a microbatch per stage: {batch // micro} microbatches for {len(stages)} stages; "
            "raise --training.local_batch_size or lower --parallelism.pipeline_parallel_microbatch_size"
        )
    if v_shape and not torch.accelerator.is_available() and torch.__version__ < "2.13":
        raise ConfigError(
            f"{SCHEDULE}={schedule!r} on CPU (gloo) needs torch 2.13 or later: torch {torch.__version__}'s V-shaped "
            "schedules first send to their own rank, which gloo cannot (the job stalls until its timeout); pick another schedule"
        )
    step_batch = training.local_batch_size * _dp_degree(job_config, world_size)
    accumulation = training.global_batch_size // step_batch if training.global_batch_size > 0 else 1
    return PPChoice(p.pipeline_parallel_degree, schedule, accumulation, tuple(tuple(s) for s in stages), v_shape)


def _check_microbatches(schedule: str, schedule_class: type, microbatches: int, degree: int) -> None:
    """What torch's schedules assert when the schedule is built, after the model: 1F1B needs a microbatch per
    stage; the interleaved ones a whole number of rounds (``max(1, microbatches // degree)``)."""
    from torch.distributed.pipelining.schedules import (
        Schedule1F1B,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    fix = ("raise --training.local_batch_size or lower --parallelism.pipeline_parallel_microbatch_size "
           "(microbatches = local batch / microbatch size)")
    if issubclass(schedule_class, Schedule1F1B) and microbatches < degree:
        raise ConfigError(
            f"{SCHEDULE}={schedule!r} needs at least one microbatch per stage: {microbatches} microbatch(es) for "
            f"{DEGREE}={degree}; {fix}"
        )
    rounds = max(1, microbatches // degree)
    if issubclass(schedule_class, (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)) and microbatches % rounds:
        raise ConfigError(
            f"{SCHEDULE}={schedule!r} runs the microbatches in rounds of {DEGREE}={degree}: {microbatches} "
            f"microbatches are not a multiple of its {rounds} rounds; {fix}"
        )


def _dp_degree(job_config, world_size: int) -> int:
    from titan_ext.inputs import degrees

    p = job_config.parallelism
    return degrees.shard_degree(p, world_size) * p.data_parallel_replicate_degree
