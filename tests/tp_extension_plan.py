"""A user's own model type and TP plan, outside the package (``--experimental.custom_import tp_extension_plan``).

``gla_ext`` is GLA under a model type titan_ext does not know: without the
plan below, TP stops with "no tensor-parallel plan for model_type 'gla_ext'".
The plan reuses GLA's attention and MLP plans.
"""

import dataclasses

from fla.models import GLAConfig, GLAForCausalLM
from torchtitan.protocols import train_spec

import titan_ext  # noqa: F401  (titan_ext's train specs)
from model_plans import GLATPPlan, register_tp_plan
from titan_ext.models.gla import GLAModelArgs
from titan_ext.train_specs import hf_train_spec


class GLAExtConfig(GLAConfig):
    model_type = "gla_ext"

    def __init__(self, **kwargs):  # an own __init__ keeps transformers from re-wrapping the subclass
        super().__init__(**kwargs)


class GLAExtForCausalLM(GLAForCausalLM):
    config_class = GLAExtConfig


@dataclasses.dataclass
class GLAExtModelArgs(GLAModelArgs):
    model_type = "gla_ext"
    hf_config = "tp_extension_plan:GLAExtConfig"
    hf_model = "tp_extension_plan:GLAExtForCausalLM"


@register_tp_plan("gla_ext")
class ExtGLATPPlan(GLATPPlan):
    pass


if "tp_ext_gla" not in train_spec._extra_train_specs:
    debug = GLAExtModelArgs(hidden_size=64, num_hidden_layers=2, num_heads=4, vocab_size=2048)
    train_spec.register_train_spec("tp_ext_gla", hf_train_spec({"debugmodel": debug}))
