"""fla's Gated Linear Attention (``GLAForCausalLM``)."""

from __future__ import annotations

from model_plans import mixers
from model_plans.base import Plan, TPPlan
from model_plans.registry import register_tp_plan


@register_tp_plan("gla")
class GLATPPlan(TPPlan):
    """GLA blocks: the mixer's entries are ``model_plans.mixers.gla``."""

    def attn_plan(self) -> Plan:
        return mixers.gla(self)
