"""Declarative tensor-parallel plans: ``TPPlan`` (a model's plan as data), its styles, the translation of a
transformers model's own HF plan, and the registry of plans by ``config.model_type``.

Depends on torch (fla's parallel styles and torchao's Float8 styles are imported when a plan that uses them is
built), not on torchtitan or titan_ext, so plans can be tested and reused outside a trainer. Each token mixer's
own entries live with the mixer (``titan_ext.models.mixers``); a plan registered for a model type covers the
layers of its architecture's own mixer. A new architecture registers its plan from the user's own module::

    from model_plans import TPPlan, register_tp_plan

    @register_tp_plan("my_model")
    class MyTPPlan(TPPlan):
        def attn_plan(self): return {"attn.q_proj": self.colwise(), ...}
"""

from model_plans.apply import apply_tp, enable_async_tp, resolve
from model_plans.base import IfPresent, TPOptions, TPPlan, with_layer_mixers
from model_plans.deepseek_v3 import DeepseekV3TPPlan
from model_plans.kimi_linear import KimiLinearTPPlan
from model_plans.hf_plan import HFTPPlan, hf_plan_class
from model_plans.registry import get_tp_plan, plan_for_model, plan_source, register_tp_plan, registered_model_types
from model_plans.validate import validate_tp

__all__ = [
    "DeepseekV3TPPlan",
    "HFTPPlan",
    "KimiLinearTPPlan",
    "IfPresent",
    "TPOptions",
    "TPPlan",
    "apply_tp",
    "enable_async_tp",
    "get_tp_plan",
    "hf_plan_class",
    "plan_for_model",
    "plan_source",
    "register_tp_plan",
    "registered_model_types",
    "resolve",
    "validate_tp",
    "with_layer_mixers",
]
