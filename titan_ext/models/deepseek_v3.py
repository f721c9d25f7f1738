"""transformers' DeepSeek-V3 (``model_type "deepseek_v3"``): MLA in every layer."""

from __future__ import annotations

from titan_ext.models import mixers
from titan_ext.models.architecture import TransformersArchitecture, register_architecture


@register_architecture
class DeepseekV3(TransformersArchitecture):
    model_type = "deepseek_v3"
    mixer = mixers.TransformersMLA()
