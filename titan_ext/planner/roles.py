"""A layout planned: one RankPlan per role (rank 0, and the first rank of each further pipeline stage), each
simulated in full or extrapolated from a cheaper simulation (fewer microbatches, fewer blocks)."""

from __future__ import annotations

import tempfile

from titan_ext.errors import ConfigError
from titan_ext.planner import blocks, microbatches, rank
from titan_ext.planner.rank import Phases, Stepping, simulate_rank
from titan_ext.planner.stages import StagesSeen


def plan_layout(job_config, world: int, phases: Phases | None = None, extrapolate: bool | None = None,
                reuse: bool = True, by_blocks: bool | None = None) -> list:
    """One RankPlan per role, planned in pipeline order: each rank learns its input's shapes from the stage
    before it, and a rank whose stage is an interior twin of one stepped before takes that one's plan
    (``stages.twin_key``). ``reuse=False``: each rank planned on its own (the other ranks' stages built, every
    rank stepped), for the tests.

    ``extrapolate``: a pipelined rank stepped with fewer microbatches and extrapolated to the job's
    (``microbatches``; None: where that is cheaper and the schedule is one ``tests/test_plan.py`` verifies it
    for; False: never; True: wherever m exceeds that count, for the tests). ``by_blocks``: a model of identical
    blocks planned with 2 and 3 blocks per pipeline stage and extrapolated to its own (``blocks``; None: where
    that is cheaper, True: wherever it applies, for the tests, False: never)."""
    checked = None
    if by_blocks is not False:
        found, checked = _by_blocks(job_config, world, phases, extrapolate, reuse, by_blocks is True)
        if found is not None:
            return found
    return _by_microbatches(job_config, world, checked, phases, extrapolate, reuse)


def _ranks(job_config, world: int, phases, reuse: bool, attribute: bool = False) -> list:
    """Each role's rank simulated, in pipeline order (with the rank's own fewest microbatches where
    ``attribute``)."""
    pp = job_config.parallelism.pipeline_parallel_degree
    seen = StagesSeen()
    return [simulate_rank(job_config, world, stage * (world // pp),
                          Stepping(phases, seen if reuse else None, attribute,
                                   microbatches.stage_microbatches(job_config, stage) if attribute else None))
            for stage in range(pp)]


def _by_microbatches(job_config, world: int, checked, phases, extrapolate, reuse: bool) -> list:
    """The layout's ranks, pipelined ones stepped with fewer microbatches and extrapolated where that applies
    (``microbatches.stepped_microbatches``); else each stepped with the job's own."""
    count = microbatches.stepped_microbatches(job_config, extrapolate)
    if count is None:
        return _ranks(job_config, world, phases, reuse)
    plan = checked or rank.checked_plan(job_config, world)  # the job's own refusals first, and its plan
    if plan.data_parallel is not None and (plan.data_parallel.reshard_blocks or plan.data_parallel.reshard_head):
        # FSDP gathers again in the middle microbatches, as the schedule's order has it
        return _ranks(job_config, world, phases, reuse)
    m = microbatches.job_microbatches(job_config)
    try:
        stepped = _ranks(microbatches.with_microbatches(job_config, count), world, phases, reuse, attribute=True)
        return [microbatches.extrapolated(planned, m, plan) for planned in stepped]
    except (ConfigError, microbatches.NotAffine):  # a check the smaller batch fails (a global batch), or not affine
        return _ranks(job_config, world, phases, reuse)


def _by_blocks(job_config, world: int, phases, extrapolate, reuse: bool, forced: bool):
    """(The layout from its plans at ``blocks.BLOCK_POINTS`` blocks per stage, or None where that does not
    apply, is not cheaper unless ``forced``, or a count would go negative; the job's checked plan, None without
    a ``[titan_ext]`` section), which the full planning reuses. Not for a hybrid, AC every Nth block, or several
    stages per rank."""
    import copy

    from torchtitan.protocols import train_spec as registry

    if getattr(getattr(job_config, "titan_ext", None), "hf_config", None) is None:
        return None, None
    model_args = copy.deepcopy(registry.get_train_spec(job_config.model.name).model_args[job_config.model.flavor])
    plan = rank.checked_plan(job_config, world, model_args)  # the job's own refusals first
    found = blocks.blocks_of(model_args, plan) if blocks.alike(model_args, plan) else None
    if found is None or not blocks.worth_it(found, forced):
        return None, plan
    smaller = []
    with tempfile.TemporaryDirectory(prefix="titan_ext_plan_") as folder:
        for point in blocks.BLOCK_POINTS:
            job = blocks.smaller_job(job_config, model_args, plan, found, point, folder)
            try:
                smaller.append(plan_layout(job, world, phases, extrapolate, reuse, by_blocks=False))
            except ConfigError:
                return None, plan  # a check the smaller model does not pass: planned in full
    return blocks.extrapolated(smaller, found, plan), plan
