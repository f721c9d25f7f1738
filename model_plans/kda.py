"""fla's Kimi Delta Attention (``KDAForCausalLM``)."""

from __future__ import annotations

from model_plans import mixers
from model_plans.base import Plan, TPPlan
from model_plans.registry import register_tp_plan


@register_tp_plan("kda")
class KDATPPlan(TPPlan):
    """KDA blocks: the mixer's entries are ``model_plans.mixers.kda``."""

    def attn_plan(self) -> Plan:
        return mixers.kda(self)
