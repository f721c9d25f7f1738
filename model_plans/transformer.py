"""fla's softmax-attention ``TransformerForCausalLM``."""

from __future__ import annotations

from model_plans import mixers
from model_plans.base import Plan, TPPlan
from model_plans.registry import register_tp_plan


@register_tp_plan("transformer")
class TransformerTPPlan(TPPlan):
    """fla transformer blocks: the mixer's entries are ``model_plans.mixers.fla_attention``."""

    def attn_plan(self) -> Plan:
        return mixers.fla_attention(self)
