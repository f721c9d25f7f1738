"""A user's own model type and TP plan, outside the package (``--experimental.custom_import tp_extension_plan``).

``gla_ext`` is GLA under a model type titan_ext does not know: without the
plan below, TP stops with "no tensor-parallel plan for model_type 'gla_ext'".
The plan reuses GLA's attention and MLP plans and logs a marker per block,
so a test can see it was the one applied.
"""

import dataclasses

import titan_ext  # noqa: F401  (CPU mode, kernels, titan_ext's train specs)
from fla.models import GLAConfig
from torchtitan.protocols.train_spec import register_train_spec
from torchtitan.tools.logging import logger

from model_plans import GLATPPlan, register_tp_plan
from titan_ext.models.gla import GLAForTitan, GLAModelArgs
from titan_ext.train_specs import hf_train_spec

MARKER = "tp_extension_plan: ExtGLATPPlan block plan"


class GLAExtConfig(GLAConfig):
    model_type = "gla_ext"

    def __init__(self, **kwargs):  # an own __init__ keeps transformers from re-wrapping the subclass
        super().__init__(**kwargs)


@dataclasses.dataclass
class GLAExtModelArgs(GLAModelArgs):
    hf_config_class = GLAExtConfig


class GLAExtForTitan(GLAForTitan):
    config_class = GLAExtConfig


@register_tp_plan("gla_ext")
class ExtGLATPPlan(GLATPPlan):
    def block_plan(self):
        logger.info(MARKER)
        return super().block_plan()


register_train_spec(
    "tp_ext_gla",
    hf_train_spec(
        "tp_ext_gla",
        GLAExtForTitan,
        {"debugmodel": GLAExtModelArgs(hidden_size=64, num_hidden_layers=2, num_heads=4, vocab_size=2048)},
    ),
)
