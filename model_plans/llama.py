"""transformers' ``LlamaForCausalLM`` (HF names)."""

from __future__ import annotations

from model_plans.base import Plan, TPPlan
from model_plans.registry import register_tp_plan


@register_tp_plan("llama")
class LlamaTPPlan(TPPlan):
    embeddings = "model.embed_tokens"
    attn_norm = "input_layernorm"
    mlp_norm = "post_attention_layernorm"

    def attn_plan(self) -> Plan:
        return {
            **self.gather("self_attn", kwarg="hidden_states"),
            "self_attn.q_proj": self.colwise(),
            "self_attn.k_proj": self.colwise(),
            "self_attn.v_proj": self.colwise(),
            "self_attn.o_proj": self.out_proj(),
        }
