"""Apply a ``TPPlan`` to a model with ``parallelize_module``."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from model_plans.base import IfPresent, Plan, TPPlan
from model_plans.styles import is_float8_style, plain_style

logger = logging.getLogger(__name__)


def _is_float8_linear(module: nn.Module) -> bool:
    from torchao.float8.float8_linear import Float8Linear

    return isinstance(module, Float8Linear)


def _style_fits(style, module: nn.Module) -> bool:
    """A Float8 style needs Float8Linear: the module itself, or every linear a Float8 input reaches."""
    if not is_float8_style(style):
        return True
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    return bool(linears) and all(_is_float8_linear(m) for m in linears)


def resolve(plan: Plan, root: nn.Module, plan_name: str = "the plan") -> Plan:
    """Plain styles for the modules ``root`` has; a missing module is an error unless its entry is ``IfPresent``.

    High-precision styles replace Float8 ones where the converter skipped a linear.
    """
    resolved = {}
    for fqn, entry in plan.items():
        style = entry.style if isinstance(entry, IfPresent) else entry
        try:
            module = root.get_submodule(fqn)
        except AttributeError:
            if isinstance(entry, IfPresent):
                continue
            raise ValueError(
                f"{plan_name} names {fqn!r}, which {type(root).__name__} does not have; fix the entry's name, "
                "or wrap its style in model_plans.IfPresent if some configurations lack the module"
            ) from None
        if not _style_fits(style, module):
            logger.info(f"TP: {fqn} is not Float8Linear (filtered by the converter?); using {type(plain_style(style)).__name__}")
            style = plain_style(style)
        resolved[fqn] = style
    return resolved


def _check_coverage(model: nn.Module, plan: TPPlan) -> None:
    """Every parameter must be a DTensor: a plain one would mix with DTensors (or be silently unsynchronized)."""
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            raise ValueError(
                f"parameter {name} is not covered by {type(plan).__name__}; add a plan entry for its module"
            )


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan) -> None:
    """Shard ``model`` in place: the model-level plan, then each block's."""
    name = type(plan).__name__
    parallelize_module(model, tp_mesh, resolve(plan.model_plan(), model, name))
    retie_embeddings(model, plan)
    for index, block in model.get_submodule(plan.layers).named_children():  # a pipeline stage's keep their indices
        parallelize_module(block, tp_mesh, resolve(plan.block_plan(int(index)), block, name))
    _check_coverage(model, plan)


def retie_embeddings(model: nn.Module, plan: TPPlan) -> None:
    """A tied output head shares the embedding's weight again (``tie_word_embeddings``).

    Each style distributes the parameters of its module: the embedding (rowwise) and the head (colwise)
    would each get a DTensor copy of the one weight, and train apart. Both shard it on the vocabulary
    (``Shard(0)``), so the head takes the embedding's DTensor: one weight, sharded once, gradients from both.
    """
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return
    try:
        embeddings, head = model.get_submodule(plan.embeddings), model.get_submodule(plan.lm_head)
    except AttributeError:  # a stage without the head (a head's stage keeps the embedding: titan_ext.parallel.pipeline)
        return
    if embeddings.weight.placements != head.weight.placements:
        raise ValueError(
            f"{type(plan).__name__} shards the tied {plan.embeddings}.weight as {embeddings.weight.placements} and "
            f"{plan.lm_head}.weight as {head.weight.placements}; a tied weight needs one layout: shard both on the "
            "vocabulary (Shard(0)), or set tie_word_embeddings to false"
        )
    head.weight = embeddings.weight


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Let inductor overlap TP matmuls with their collectives (needs torch.compile).

    The fused kernels exchange through symmetric memory, which must be enabled
    for the TP group (torchtitan 0.2.2 forgets this step).
    """
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
