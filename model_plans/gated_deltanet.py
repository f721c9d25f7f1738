"""fla's Gated DeltaNet (``GatedDeltaNetForCausalLM``)."""

from __future__ import annotations

from model_plans import mixers
from model_plans.base import Plan, TPPlan
from model_plans.registry import register_tp_plan


@register_tp_plan("gated_deltanet")
class GatedDeltaNetTPPlan(TPPlan):
    """Gated DeltaNet blocks: the mixer's entries are ``model_plans.mixers.gated_deltanet``."""

    def attn_plan(self) -> Plan:
        return mixers.gated_deltanet(self)
