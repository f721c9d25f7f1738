"""transformers' ``KimiLinearForCausalLM`` (HF names): MLA layers, KDA layers (``layer_mixers``), dense gated
MLPs and MoE blocks (``mlp_layer_types`` ``sparse``).

A MoE block (``KimiLinearMoE``) is laid out as the translated HF plans lay out theirs (``model_plans.hf_plan``,
torchtitan's ETP=1): its input gathered, its stacked ``experts`` placed by expert parallelism over the TP ranks'
token shares (``TPOptions.expert_parallel``; without EP ``validate_tp`` refuses the MoE layers), its router
(``gate``) replicated, its ``shared_experts`` a dense FFN split by TP whose output is this rank's partial share.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from model_plans import mixers
from model_plans.base import IfPresent, Plan, TPPlan
from model_plans.registry import register_tp_plan
from model_plans.styles import Composed, PlacedElsewhere


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

    def attn_plan(self) -> Plan:
        return mixers.transformers_mla(self)

    def mlp_plan(self) -> Plan:
        dense = super().mlp_plan()
        plan = {
            "mlp": DenseOrMoE(dense["mlp"], self.moe_block()),
            **{path: s if isinstance(s, IfPresent) else IfPresent(s) for path, s in dense.items() if path != "mlp"},
            "mlp.gate": IfPresent(Composed(self.router(), ReplicatedBuffers())),
            "mlp.shared_experts.gate_proj": IfPresent(self.colwise()),
            "mlp.shared_experts.up_proj": IfPresent(self.colwise()),
            "mlp.shared_experts.down_proj": IfPresent(self.shared_out_proj()),
        }
        if self.options.expert_parallel:  # without EP validate_tp refuses MoE layers
            plan["mlp.experts"] = IfPresent(PlacedElsewhere("expert parallelism"))
        return plan
