"""Checks of the numbers and parallel degrees of a job config, against the world size."""

from __future__ import annotations

import math

from titan_ext.errors import ConfigError


# The degrees whose product must be the world size, in torchtitan's ParallelDims order.
_MESH = ("data_parallel_replicate_degree", "data_parallel_shard_degree", "context_parallel_degree",
         "tensor_parallel_degree", "pipeline_parallel_degree")  # fmt: skip


def _degrees_at_least_one(parallelism) -> None:
    """torchtitan asserts these with a bare ``AssertionError`` while building the mesh."""
    for name in (*_MESH, "expert_parallel_degree", "expert_tensor_parallel_degree"):
        value = getattr(parallelism, name)
        if name == "data_parallel_shard_degree" and value == -1:
            continue
        if value < 1:
            allowed = "-1 (the remaining ranks) or >= 1" if name == "data_parallel_shard_degree" else ">= 1"
            raise ConfigError(f"--parallelism.{name}={value} must be {allowed}; use 1 to turn it off")


def check_positive_numbers(job_config) -> None:
    """Zero or negative sizes make torchtitan divide by zero, build empty batches or skip training."""
    _degrees_at_least_one(job_config.parallelism)
    training = job_config.training
    for name in ("seq_len", "local_batch_size", "steps"):
        value = getattr(training, name)
        if value <= 0:
            raise ConfigError(f"--training.{name}={value} must be positive; set a positive integer")
    if training.global_batch_size == 0 or training.global_batch_size < -1:
        raise ConfigError(
            f"--training.global_batch_size={training.global_batch_size} is invalid; "
            "set a positive multiple of local batch x data-parallel degree, or -1 for exactly that"
        )


def _product_text(parallelism, names) -> str:
    """``--parallelism.a=2 x --parallelism.b=2``: the shard degree and the degrees that are not 1."""
    shown = [n for n in names if getattr(parallelism, n) != 1 or n == "data_parallel_shard_degree"]
    return " x ".join(f"--parallelism.{n}={getattr(parallelism, n)}" for n in shown)


def shard_degree(parallelism, world_size: int) -> int:
    """The FSDP degree the mesh gets: ``-1`` takes the ranks the other degrees leave."""
    others = [n for n in _MESH if n != "data_parallel_shard_degree"]
    rest = math.prod(getattr(parallelism, n) for n in others)
    shard = parallelism.data_parallel_shard_degree
    if shard == -1 and world_size % rest:
        raise ConfigError(
            f"{_product_text(parallelism, others)} = {rest} ranks does not divide the {world_size} ranks torchrun "
            f"started (WORLD_SIZE), so --parallelism.data_parallel_shard_degree=-1 has no whole value; "
            f"pick degrees whose product divides {world_size}"
        )
    if shard == -1:
        return world_size // rest
    if rest * shard != world_size:
        raise ConfigError(
            f"{_product_text(parallelism, _MESH)} = {rest * shard} ranks, but torchrun started {world_size} "
            f"(WORLD_SIZE); make the product {world_size}, e.g. --parallelism.data_parallel_shard_degree=-1 "
            "to use the rest"
        )
    return shard


def _check_expert_degrees(parallelism, shard: int) -> None:
    """torchtitan's expert mesh: etp is 1 or tp, and ep x etp splits dp_shard x cp x tp."""
    ep, etp, tp = (parallelism.expert_parallel_degree, parallelism.expert_tensor_parallel_degree,
                   parallelism.tensor_parallel_degree)  # fmt: skip
    if ep == 1:
        return
    if etp not in (1, tp):
        raise ConfigError(
            f"--parallelism.expert_tensor_parallel_degree={etp} must be 1 or "
            f"--parallelism.tensor_parallel_degree={tp} when --parallelism.expert_parallel_degree={ep}; set one"
        )
    dense = shard * parallelism.context_parallel_degree * tp
    if dense % (ep * etp):
        raise ConfigError(
            f"--parallelism.expert_parallel_degree={ep} x --parallelism.expert_tensor_parallel_degree={etp} "
            f"does not divide data_parallel_shard x context_parallel x tensor_parallel = {dense}; "
            f"pick expert degrees whose product divides {dense}"
        )


def _check_global_batch(training, data_parallel: int) -> None:
    """torchtitan asserts this only after building the model."""
    step = training.local_batch_size * data_parallel
    if training.global_batch_size > 0 and training.global_batch_size % step:
        raise ConfigError(
            f"--training.global_batch_size={training.global_batch_size} is not a multiple of "
            f"--training.local_batch_size={training.local_batch_size} x {data_parallel} data-parallel ranks "
            f"= {step}; set a multiple of {step}, or -1"
        )


def check_parallel_degrees(job_config, world_size: int) -> None:
    """The degrees torchtitan's ``ParallelDims`` accepts for ``world_size`` ranks, and a batch they split."""
    parallelism = job_config.parallelism
    _degrees_at_least_one(parallelism)
    shard = shard_degree(parallelism, world_size)
    _check_expert_degrees(parallelism, shard)
    _check_global_batch(job_config.training, parallelism.data_parallel_replicate_degree * shard)
