"""fla's softmax-attention transformer (``model_type "transformer"``): architecture and flavors.

Without the flash-attn package, attention runs through PyTorch SDPA
(``titan_ext.kernels.sdpa_attention``, bound into titan_ext's model only);
parameter names and math stay fla's.
"""

from __future__ import annotations

from titan_ext.models import mixers
from titan_ext.models.architecture import FlaArchitecture, register_architecture
from titan_ext.models.args import fla_model


@register_architecture
class Transformer(FlaArchitecture):
    model_type = "transformer"
    mixer = mixers.FlaAttention


def transformer(**fields):
    return fla_model("transformer", **fields)


# 340M, 1B and 7B are flame's configs/transformer_*.json (fla-hub's transformer checkpoints).
transformer_flavors = {
    "debugmodel": transformer(
        hidden_size=64, num_hidden_layers=2, num_heads=4, num_kv_heads=2, vocab_size=2048, max_position_embeddings=512
    ),
    "340M": transformer(hidden_size=1024, num_hidden_layers=24, num_heads=16, vocab_size=32000,
                        max_position_embeddings=8192),
    "1B": transformer(hidden_size=2048, num_hidden_layers=24, num_heads=32, vocab_size=32000,
                      max_position_embeddings=8192),
    "7B": transformer(
        hidden_size=4096, num_hidden_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
        max_position_embeddings=2048, vocab_size=32000,
    ),
}
