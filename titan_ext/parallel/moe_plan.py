"""The plan-time MoE choice (``JobPlan.moe``) and the MoE layouts titan_ext cannot follow, refused in one line
from the meta-device model before anything is built: expert parallelism, the experts' TP split, and the
balancing option."""

from __future__ import annotations

import torch
import torch.nn as nn

from titan_ext.errors import ConfigError
from titan_ext.job_plan import MoEChoice
from titan_ext.models.moe.bias_router import ROUTER_FIELDS
from titan_ext.models.moe.blocks import (STACKED, moe_blocks, moe_layer_indices, router_of, stacked_plainly,
                                        without_moe_blocks)


BALANCES = ("aux_loss", "bias")
"""``[titan_ext] moe_balance``'s values."""


def balance_option(job_config) -> str:
    return getattr(getattr(job_config, "titan_ext", None), "moe_balance", "aux_loss")


def moe_choice(model: nn.Module, job_config=None) -> MoEChoice | None:
    """From the meta model: None for a dense model. With the routing bias the loss needs no router logits and
    the routers count their own tokens."""
    blocks = moe_blocks(model)
    if not blocks:
        return None
    gate = router_of(blocks[0])
    balance = balance_option(job_config)
    coef = float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0) if balance == "aux_loss" else 0.0
    p = job_config.parallelism if job_config is not None else None
    return MoEChoice(aux_loss_coef=coef, num_experts=gate.num_experts, top_k=gate.top_k,
                     ep=p.expert_parallel_degree if p else 1,
                     split_intermediate=bool(p) and splits_intermediate(p, blocks),
                     balance=balance, record_routers=balance == "aux_loss",
                     moe_layers=tuple(moe_layer_indices(model)))


def check_moe(model: nn.Module, job_config) -> None:
    """Expert parallelism and balancing options titan_ext cannot follow, refused in one line."""
    p = job_config.parallelism
    blocks = moe_blocks(model)
    balance = balance_option(job_config)
    if balance not in BALANCES:
        raise ConfigError(f"--titan_ext.moe_balance={balance!r} is not one of {', '.join(BALANCES)}; pick one")
    if balance == "bias" and not blocks:
        raise ConfigError(f"--titan_ext.moe_balance='bias': {without_moe_blocks(model)}; remove it")
    router = router_of(blocks[0]) if blocks else None
    if balance == "bias" and not all(hasattr(router, name) for name in ROUTER_FIELDS):
        raise ConfigError(
            f"--titan_ext.moe_balance='bias': titan_ext biases transformers' softmax top-k routers (holding "
            f"{', '.join(ROUTER_FIELDS)}); {type(router).__name__} is not one; use moe_balance='aux_loss'"
        )
    checkpoint = getattr(job_config, "checkpoint", None)
    hf_flags = [flag for flag in ("initial_load_in_hf", "last_save_in_hf") if getattr(checkpoint, flag, False)]
    if balance == "bias" and hf_flags:
        raise ConfigError(
            f"--titan_ext.moe_balance='bias' with --checkpoint.{hf_flags[0]}: transformers' {model.config.model_type} "
            "has no routing bias among its weights, so the HF checkpoint would lose it; use torchtitan's (DCP) "
            "checkpoints with the bias, or moe_balance='aux_loss'"
        )
    if p.expert_parallel_degree > 1 and not blocks:
        raise ConfigError(
            f"--parallelism.expert_parallel_degree={p.expert_parallel_degree}: {without_moe_blocks(model)}; set it to 1"
        )
    if not blocks:
        return
    if p.expert_parallel_degree > 1:
        _check_ep(blocks, p)
    if splits_intermediate(p, blocks):
        _check_split_intermediate(blocks, p)
    if p.tensor_parallel_degree > 1 and torch.__version__ < "2.13" and _softmax_top_k(router):
        raise ConfigError(
            f"--parallelism.tensor_parallel_degree={p.tensor_parallel_degree} with {type(router).__name__} needs torch "
            f"2.13 or later: torch {torch.__version__}'s DTensor cannot backpropagate the replicated router's top-k "
            "values (its backward mixes a plain tensor into a DTensor scatter); upgrade torch, or use expert "
            "parallelism or FSDP alone"
        )


def _softmax_top_k(router: nn.Module) -> bool:
    """transformers' softmax top-k router (Qwen2/3-MoE's, Qwen3-Next's, OLMoE's): it backpropagates through its
    top-k values, which torch 2.11's DTensor cannot. DeepSeek-V3's and Kimi Linear's gather their weights by the
    top-k's indices, which it can (their TP rows pass on torch 2.11); they carry a score correction bias."""
    return all(hasattr(router, name) for name in ROUTER_FIELDS) and not hasattr(router, "e_score_correction_bias")


def splits_intermediate(p, blocks: list[nn.Module]) -> bool:
    """Whether each expert's intermediate dim is split over the TP ranks: torchtitan's TP of the experts, under
    TP without EP and under EP with ``expert_tensor_parallel_degree`` equal to the TP degree (ETP=TP). Experts
    other than plainly stacked ones are split by no path: under TP without EP their block stays whole on every
    rank (as their model's HF plan, naming no split of them, leaves it; gpt-oss's), under EP refused."""
    tp = p.tensor_parallel_degree
    if p.expert_parallel_degree == 1 and not all(stacked_plainly(block.experts) for block in blocks):
        return False
    return tp > 1 and (p.expert_parallel_degree == 1 or p.expert_tensor_parallel_degree == tp)


def _check_stacked(blocks: list[nn.Module], option: str) -> None:
    for block in blocks:
        experts = block.experts
        if not stacked_plainly(experts):
            names = sorted(name for name, _ in experts.named_parameters())
            raise ConfigError(
                f"{option}: {type(experts).__name__} (holding {', '.join(names)}) has no expert-parallel path in "
                f"titan_ext, which splits experts of stacked {' and '.join(STACKED)} alone; set it to 1"
            )


def _check_ep(blocks: list[nn.Module], p) -> None:
    ep = p.expert_parallel_degree  # ETP other than 1 or the TP degree: refused with the degrees (titan_ext.host.validate)
    option = f"--parallelism.expert_parallel_degree={ep}"
    _check_stacked(blocks, option)
    for block in blocks:
        count = block.experts.gate_up_proj.shape[0]
        if count % ep:
            raise ConfigError(f"{option} does not divide the model's {count} experts; pick a divisor")


def _check_split_intermediate(blocks: list[nn.Module], p) -> None:
    tp = p.tensor_parallel_degree
    option = f"--parallelism.tensor_parallel_degree={tp}"
    _check_stacked(blocks, option)
    intermediate = blocks[0].experts.gate_up_proj.shape[1] // 2
    if intermediate % tp:
        raise ConfigError(
            f"{option} does not divide the experts' intermediate size ({intermediate}, moe_intermediate_size), "
            "which TP splits; pick a degree that divides it"
        )
