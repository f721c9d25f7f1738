"""Can TP split this model? Checked on a meta-device model before anything real is built.

The sizes to split follow from the plan: every linear a block plan shards
colwise must split its outputs, every rowwise one its inputs. Head counts come
from the config (the plan shards by whole heads, and a user fixes the field
the message names). The model-level plan only shards the vocabulary, which
DTensor splits unevenly when it must (embedding, lm_head and loss parallel
give the same loss with 33 tokens on 2 ranks), so it is not checked.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel

from model_plans.apply import resolve
from model_plans.base import TPPlan

DEGREE = "--parallelism.tensor_parallel_degree"

_HEAD_FIELDS = (("num_heads", "num_attention_heads"), ("num_kv_heads", "num_key_value_heads"), ("num_v_heads",),
                ("linear_num_key_heads",), ("linear_num_value_heads",))
"""fla's and HF's spellings of the head counts (``num_v_heads``: Gated DeltaNet's value heads; ``linear_*``:
transformers' Gated DeltaNet layers')."""


def _heads(config) -> list[tuple[str, int]]:
    found = []
    for spellings in _HEAD_FIELDS:
        for name in spellings:
            if getattr(config, name, None) is not None:
                found.append((name, getattr(config, name)))
                break
    return found


def _split_size(style, module: nn.Module) -> tuple[str, int] | None:
    """(attribute, size) of the dimension ``style`` splits in ``module``, for linears."""
    if not isinstance(module, nn.Linear):
        return None
    if isinstance(style, ColwiseParallel):  # torchao's Float8 styles subclass these
        return "out_features", module.out_features
    if isinstance(style, RowwiseParallel):
        return "in_features", module.in_features
    return None


def _unsupported(config) -> list[tuple[str, object, str]]:
    """(field, value, fix) for features the shipped plans do not shard."""
    found = []
    if getattr(config, "attnres_block_size", None) is not None:
        found.append(("attnres_block_size", config.attnres_block_size, "set it to null (attention residuals are not sharded)"))
    return found


_LAYOUT_ONLY = (PrepareModuleInput, PrepareModuleOutput)
"""Styles that lay out a module's inputs or outputs and leave its parameters alone."""


def _uncovered_parameter(model: nn.Module, plan: TPPlan, block_plans: dict[str, dict]) -> str | None:
    """The first parameter whose module no parameter-placing plan entry names, or None
    (``block_plans``: each block's resolved plan, by its name in the block list)."""
    model_plan = resolve(plan.model_plan(), model, type(plan).__name__)
    covered = {fqn for fqn, style in model_plan.items() if not isinstance(style, _LAYOUT_ONLY)}
    # modules whose style places everything beneath them (``Replicated``)
    whole = {f"{fqn}." for fqn, style in model_plan.items() if getattr(style, "covers_children", False)}
    for index, block_plan in block_plans.items():
        covered |= {f"{plan.layers}.{index}.{fqn}" for fqn, style in block_plan.items() if not isinstance(style, _LAYOUT_ONLY)}
        whole |= {f"{plan.layers}.{index}.{fqn}." for fqn, style in block_plan.items() if getattr(style, "covers_children", False)}
    for param_name, _ in model.named_parameters():
        if param_name.rpartition(".")[0] not in covered and not any(param_name.startswith(w) for w in whole):
            return param_name
    return None


def validate_tp(model: nn.Module, plan: TPPlan, tp_degree: int, seq_len: int | None = None,
                seq_option: str = "--training.seq_len") -> None:
    """Raise ``ValueError`` (one line naming the field or module, its size and the degree) if TP cannot split ``model``.

    ``model`` may live on the meta device; it needs the HF ``config``.
    """
    if tp_degree <= 1:
        return
    config = model.config
    for name, value, fix in _unsupported(config):
        raise ValueError(f"{name}={value} is not supported with {DEGREE}={tp_degree}; {fix}")
    for name, value in _heads(config):
        if value % tp_degree:
            raise ValueError(f"{name}={value} is not divisible by {DEGREE}={tp_degree}; pick a degree that divides it")
    name = type(plan).__name__
    indices, blocks = zip(*model.get_submodule(plan.layers).named_children())
    block_plans = [resolve(plan.block_plan(int(index)), block, name) for index, block in zip(indices, blocks)]
    uncovered = _uncovered_parameter(model, plan, dict(zip(indices, block_plans)))
    if uncovered:
        raise ValueError(
            f"parameter {uncovered} is not covered by {name}: TP would leave it a plain tensor among DTensors; "
            "add a plan entry for its module (a replicated style for modules TP does not split)"
        )
    for index, block, block_plan in zip(indices, blocks, block_plans):
        for fqn, style in block_plan.items():
            split = _split_size(style, block.get_submodule(fqn))
            if split is not None and split[1] % tp_degree:
                raise ValueError(
                    f"{plan.layers}.{index}.{fqn}.{split[0]}={split[1]} is not divisible by {DEGREE}={tp_degree} "
                    f"({name} splits it); pick a degree that divides it, or change the config field that sets it"
                )
    if plan.options.sequence_parallel and seq_len is not None and seq_len % tp_degree:
        raise ValueError(
            f"{seq_option}={seq_len} is not divisible by {DEGREE}={tp_degree} with sequence parallel on; "
            "pick a divisible seq_len or set [titan_ext] disable_sequence_parallel = true"
        )
