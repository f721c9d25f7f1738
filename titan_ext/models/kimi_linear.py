"""transformers' Kimi Linear (``model_type "kimi_linear"``): KDA layers, MLA layers and a MoE FFN."""

from __future__ import annotations

from titan_ext.models import mixers
from titan_ext.models.architecture import TransformersArchitecture, register_architecture


@register_architecture
class KimiLinear(TransformersArchitecture):
    """Both kinds of layer hold their mixer as ``self_attn``: ``config.layer_types`` says which
    (``full_attention``: MLA, ``linear_attention``: KDA)."""

    model_type = "kimi_linear"
    mixer = mixers.TransformersMLA()
    layer_types = {"linear_attention": mixers.TransformersKDA()}
