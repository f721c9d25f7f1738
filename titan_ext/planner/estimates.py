"""The figures a recorded step cannot give: the pipeline bubble and the time the collectives alone take."""

from __future__ import annotations

from titan_ext.planner.collectives import Collective


def accumulation_steps(job_config, parallel_dims) -> int:
    """Forward-backward passes per optimizer step (torchtitan's rule: global batch over local batch x DP)."""
    training = job_config.training
    data_parallel = parallel_dims.dp_replicate * parallel_dims.dp_shard
    if training.global_batch_size <= 0:
        return 1
    return max(1, training.global_batch_size // (training.local_batch_size * data_parallel))


def bubble(plan, job_config) -> float:
    """The idle fraction of a pipeline step: (p - 1) / (v·m + p - 1) for p ranks, v stages per rank and m
    microbatches (GPipe and 1F1B: v = 1; interleaved and looped schedules: v > 1). Zero-bubble schedules
    (ZBV, DualPipeV, InterleavedZeroBubble) fill part of it with weight-gradient work: for them this is
    the bound without that filling."""
    if plan.pp is None:
        return 0.0
    p = plan.pp.degree
    v = len(plan.pp.stages) // p
    m = job_config.training.local_batch_size // job_config.parallelism.pipeline_parallel_microbatch_size
    return (p - 1) / (v * m + p - 1)


def collective_seconds(collectives: list[Collective], link_gbps: float, passes: int = 1) -> float:
    """Seconds each rank spends sending, if every collective ran alone over one link of ``link_gbps`` GB/s
    in a bandwidth-optimal ring (no overlap with compute or each other, no latency): a lower bound on the
    step time for one optimizer step of ``passes`` forward-backward passes."""
    return passes * sum(c.wire_bytes() for c in collectives) / (link_gbps * 1e9)


def step_seconds(planned, link_gbps: float, passes: int = 1) -> float:
    """``collective_seconds`` of the rank that sends the most (under PP the stages' ranks differ)."""
    return max(collective_seconds(list(rank.collectives), link_gbps, passes) for rank in planned)
