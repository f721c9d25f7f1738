"""transformers' ``KimiLinearForCausalLM`` (HF names): MLA layers, KDA layers (``layer_mixers``), a dense gated
MLP (its MoE layers have no TP entries: ``validate_tp`` names them)."""

from __future__ import annotations

from model_plans import mixers
from model_plans.base import Plan, TPPlan
from model_plans.registry import register_tp_plan


@register_tp_plan("kimi_linear")
class KimiLinearTPPlan(TPPlan):
    embeddings = "model.embed_tokens"
    attn_norm = "input_layernorm"
    mlp_norm = "post_attention_layernorm"

    def attn_plan(self) -> Plan:
        return mixers.transformers_mla(self)
