"""transformers' Qwen3-MoE (``model_type "qwen3_moe"``, Qwen3-30B-A3B and 235B-A22B): softmax attention with
per-head query and key norms in every layer, a mixture of experts as each FFN. The attention reaches CP through
its modeling file's attention registry, as Llama's does."""

from __future__ import annotations

from titan_ext.models import mixers
from titan_ext.models.architecture import TransformersArchitecture, register_architecture


@register_architecture
class Qwen3Moe(TransformersArchitecture):
    model_type = "qwen3_moe"
    mixer = mixers.TransformersAttention()
