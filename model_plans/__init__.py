"""Declarative tensor-parallel plans per architecture, keyed by ``config.model_type``.

Depends on torch (fla's parallel styles and torchao's Float8 styles are
imported when a plan that uses them is built), not on torchtitan, so plans
can be tested and reused outside a trainer. A new architecture registers its plan
from the user's own module::

    from model_plans import GLATPPlan, register_tp_plan

    @register_tp_plan("my_gla")
    class MyGLATPPlan(GLATPPlan): ...
"""

from model_plans.apply import apply_tp, enable_async_tp, resolve
from model_plans import mixers
from model_plans.base import IfPresent, TPOptions, TPPlan, with_layer_mixers
from model_plans.deepseek_v3 import DeepseekV3TPPlan
from model_plans.gated_deltanet import GatedDeltaNetTPPlan
from model_plans.gla import GLATPPlan
from model_plans.kda import KDATPPlan
from model_plans.kimi_linear import KimiLinearTPPlan
from model_plans.hf_plan import HFTPPlan, hf_plan_class
from model_plans.llama import LlamaTPPlan
from model_plans.registry import get_tp_plan, plan_for_model, plan_source, register_tp_plan, registered_model_types
from model_plans.transformer import TransformerTPPlan
from model_plans.validate import validate_tp

__all__ = [
    "DeepseekV3TPPlan",
    "GatedDeltaNetTPPlan",
    "GLATPPlan",
    "HFTPPlan",
    "KDATPPlan",
    "KimiLinearTPPlan",
    "LlamaTPPlan",
    "IfPresent",
    "TPOptions",
    "TPPlan",
    "TransformerTPPlan",
    "apply_tp",
    "enable_async_tp",
    "get_tp_plan",
    "hf_plan_class",
    "mixers",
    "plan_for_model",
    "plan_source",
    "register_tp_plan",
    "registered_model_types",
    "resolve",
    "validate_tp",
    "with_layer_mixers",
]
