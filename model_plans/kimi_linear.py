"""transformers' ``KimiLinearForCausalLM`` (HF names): dense gated MLPs and MoE blocks (``mlp_layer_types``
``sparse``); its MLA and KDA layers take their mixers' own entries (``layer_mixers``).

A MoE block (``KimiLinearMoE``, DeepSeek-V3's layout) is laid out as the translated HF plans lay out theirs
(``model_plans.hf_plan``): its input gathered, its stacked ``experts`` placed by ``titan_ext.parallel.expert_parallel``
(``experts_placed``: each expert's intermediate dim split over TP, or expert parallelism), its router (``gate``)
replicated, its ``shared_experts`` a dense FFN split by TP whose output is this rank's partial share.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from model_plans.base import IfPresent, Plan, TPPlan, experts_placed
from model_plans.registry import register_tp_plan
from model_plans.styles import Composed


class ReplicatedBuffers(ParallelStyle):
    """A module's own buffers made replicated DTensors, for a router computed on replicated DTensors (Kimi's
    ``e_score_correction_bias``, added to its scores)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, buffer in list(module.named_buffers(recurse=False)):  # assigned in place: stays (non)persistent
            replicated = distribute_tensor(buffer, device_mesh, (Replicate(),), src_data_rank=self.src_data_rank)
            setattr(module, name, replicated)
        return module

    def __repr__(self) -> str:
        return "ReplicatedBuffers()"


class DenseOrMoE(ParallelStyle):
    """The ``mlp`` of a layer: ``dense``'s style on a gated MLP, ``moe``'s on a MoE block (one with ``experts``);
    the plan names the module once for both kinds of layer."""

    def __init__(self, dense: ParallelStyle, moe: ParallelStyle):
        super().__init__()
        self.dense, self.moe = dense, moe

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        style = self.moe if hasattr(module, "experts") else self.dense
        style.src_data_rank = self.src_data_rank
        return style._apply(module, device_mesh)

    def __repr__(self) -> str:
        return f"DenseOrMoE({self.dense!r}, {self.moe!r})"


@register_tp_plan("kimi_linear")
class KimiLinearTPPlan(TPPlan):
    embeddings = "model.embed_tokens"
    attn_norm = "input_layernorm"
    mlp_norm = "post_attention_layernorm"

    def mlp_plan(self) -> Plan:
        return dense_or_moe_plan(self)


def dense_or_moe_plan(plan: TPPlan) -> Plan:
    """The ``mlp`` of DeepSeek-V3's and Kimi Linear's layers: a gated MLP or a MoE block (a grouped router with
    a score-correction bias, stacked experts, shared experts)."""
    dense = TPPlan.mlp_plan(plan)
    return {
        "mlp": DenseOrMoE(dense["mlp"], plan.moe_block()),
        **{path: s if isinstance(s, IfPresent) else IfPresent(s) for path, s in dense.items() if path != "mlp"},
        "mlp.gate": IfPresent(Composed(plan.router(), ReplicatedBuffers())),
        "mlp.shared_experts.gate_proj": IfPresent(plan.colwise()),
        "mlp.shared_experts.up_proj": IfPresent(plan.colwise()),
        "mlp.shared_experts.down_proj": IfPresent(plan.shared_out_proj()),
        "mlp.experts": IfPresent(experts_placed(plan.options)),
    }
