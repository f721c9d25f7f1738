"""transformers' Qwen3.5 (``qwen3_5_text``) and Qwen3-Next (``qwen3_next``, its FFN a mixture of experts): Gated
DeltaNet layers (``linear_attention``) and gated softmax attention with partial rotary (``full_attention``)."""

from __future__ import annotations

from titan_ext.models import mixers
from titan_ext.models.architecture import TransformersArchitecture, register_architecture


@register_architecture
class Qwen3_5(TransformersArchitecture):
    """Its attention layers take CP's ring (or all-gathered) attention through their modeling file's attention
    registry, on the mesh and pieces of the Gated DeltaNet layers' state passing (``context_parallel``)."""

    model_type = "qwen3_5_text"
    mixer = mixers.TransformersAttention()


@register_architecture
class Qwen3Next(Qwen3_5):
    model_type = "qwen3_next"
