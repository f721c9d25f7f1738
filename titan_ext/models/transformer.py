"""fla's softmax-attention transformer (``model_type "transformer"``): architecture and flavors.

Without the flash-attn package, attention runs through PyTorch SDPA
(``titan_ext.kernels.sdpa_attention``, bound into titan_ext's model only);
parameter names and math stay fla's.
"""

from __future__ import annotations

from titan_ext.models.architecture import FlaArchitecture, register_architecture
from titan_ext.models.args import fla_model


@register_architecture
class Transformer(FlaArchitecture):
    model_type = "transformer"
    cp_attention = "fla"

    def ring_attention_blocker(self, config):
        return f"window_size={config.window_size}" if config.window_size else None

    def mixer_flops_per_token(self, config, seq_len):
        """Softmax attention beyond the projections: 12 * layers * heads * head_dim * keys.

        Per layer, head and token the forward computes q.k over the keys and
        the weighted sum of values, 2 * 2 * head_dim * keys; training is 3x.
        Keys = seq_len (the full score matrix, no causal halving, as
        torchtitan's llama3 and flame count it), or the window when smaller.
        fla's heads * head_dim is hidden_size.
        """
        keys = min(seq_len, config.window_size or seq_len)
        return 12 * config.num_hidden_layers * config.hidden_size * keys


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
