"""Tensor parallelism from torchtitan's job config: pick the plan and its variant, check, apply.

``parallelize_hf_model`` calls ``apply_tp_from_config`` first (before AC,
compile and FSDP), as torchtitan orders them. The plans themselves live in
``model_plans`` (torch only); this module maps job-config options onto them.
"""

from __future__ import annotations

import torch.nn as nn
from torchtitan.tools.logging import logger

from model_plans import TPOptions, TPPlan, apply_tp, enable_async_tp, get_tp_plan, validate_tp

from titan_ext.float8 import CONVERTER


def sequence_parallel_enabled(job_config) -> bool:
    """``[titan_ext] disable_sequence_parallel`` (torchtitan has no flag for it); on by default."""
    section = getattr(job_config, "titan_ext", None)
    return not getattr(section, "disable_sequence_parallel", False)


def float8_tp_enabled(job_config) -> bool:
    """torchao's Float8 TP styles all-gather in float8 with one scale per tensor: tensorwise recipes only."""
    if CONVERTER not in job_config.model.converters:
        return False
    return job_config.quantize.linear.float8.recipe_name in (None, "tensorwise")


def tp_options(job_config) -> TPOptions:
    return TPOptions(
        sequence_parallel=sequence_parallel_enabled(job_config),
        loss_parallel=not job_config.parallelism.disable_loss_parallel,
        float8=float8_tp_enabled(job_config),
    )


def check_async_tp(job_config) -> None:
    if job_config.parallelism.enable_async_tensor_parallel and not job_config.compile.enable:
        raise ValueError(
            "--parallelism.enable_async_tensor_parallel needs torch.compile (its collective-matmul fusion is an "
            "inductor pass); add --compile.enable or drop async TP"
        )


def check_tp(config, tp_degree: int, job_config) -> type[TPPlan]:
    """What TP needs from the model's HF config; returns the registered plan class.

    Runs in preflight (before the model is built) and again when applying, so
    ``apply_tp_from_config`` is safe to call on its own. Callers check async TP
    first: it needs only the job config.
    """
    plan_cls = get_tp_plan(config.model_type)  # an unknown model type lists the registered ones
    validate_tp(config, tp_degree, job_config.training.seq_len, sequence_parallel_enabled(job_config))
    return plan_cls


def apply_tp_from_config(model: nn.Module, parallel_dims, job_config) -> None:
    """Validate, then shard ``model`` over the TP mesh with the plan registered for its ``model_type``."""
    options = tp_options(job_config)
    check_async_tp(job_config)
    plan = check_tp(model.config, parallel_dims.tp, job_config)(options)
    tp_mesh = parallel_dims.get_mesh("tp")
    apply_tp(model, tp_mesh, plan)
    if job_config.parallelism.enable_async_tensor_parallel:
        enable_async_tp(tp_mesh)
    logger.info(
        f"Applied {type(plan).__name__} tensor parallelism (degree {parallel_dims.tp}): "
        f"sequence_parallel={options.sequence_parallel}, loss_parallel={options.loss_parallel}, "
        f"float8={options.float8}, async={job_config.parallelism.enable_async_tensor_parallel}"
    )
