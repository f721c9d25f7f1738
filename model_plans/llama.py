"""transformers' ``LlamaForCausalLM`` (HF names)."""

from __future__ import annotations

from model_plans import mixers
from model_plans.base import Plan, TPPlan
from model_plans.registry import register_tp_plan


@register_tp_plan("llama")
class LlamaTPPlan(TPPlan):
    embeddings = "model.embed_tokens"
    attn_norm = "input_layernorm"
    mlp_norm = "post_attention_layernorm"

    def attn_plan(self) -> Plan:
        return mixers.transformers_attention(self)
