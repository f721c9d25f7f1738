"""transformers' ``DeepseekV3ForCausalLM`` (HF names): dense gated MLPs in the first ``first_k_dense_replace`` layers
and MoE blocks after them (laid out as Kimi Linear's, ``dense_or_moe_plan``); its multi-head latent attention takes
the MLA mixer's own entries (``titan_ext.models.mixers.mla``)."""

from __future__ import annotations

from model_plans.base import Plan, TPPlan
from model_plans.kimi_linear import dense_or_moe_plan
from model_plans.registry import register_tp_plan


@register_tp_plan("deepseek_v3")
class DeepseekV3TPPlan(TPPlan):
    embeddings = "model.embed_tokens"
    attn_norm = "input_layernorm"
    mlp_norm = "post_attention_layernorm"

    def mlp_plan(self) -> Plan:
        return dense_or_moe_plan(self)
