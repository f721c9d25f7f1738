"""fla's Gated Linear Attention (``model_type "gla"``, ``GLAForCausalLM``): architecture and flavors."""

from __future__ import annotations

from titan_ext.models import mixers
from titan_ext.models.architecture import FlaArchitecture, register_architecture
from titan_ext.models.args import fla_model


@register_architecture
class GLA(FlaArchitecture):
    model_type = "gla"
    mixer = mixers.GLA
    # and the low-rank gate (gk_proj.0/.1, rank 16): too little work to pay for the casts
    float8_high_precision = ("gk_proj", "lm_head")


def gla(**fields):
    return fla_model("gla", **fields)


# 340M and 1.3B follow fla-hub's gla-340M/gla-1.3B checkpoints, 7B flame's gla_7B config.
gla_flavors = {
    "debugmodel": gla(hidden_size=64, num_hidden_layers=2, num_heads=4, vocab_size=2048, max_position_embeddings=512),
    "340M": gla(hidden_size=1024, num_hidden_layers=24, num_heads=4, vocab_size=32000),
    "1.3B": gla(hidden_size=2048, num_hidden_layers=24, num_heads=4, vocab_size=32000),
    "7B": gla(hidden_size=4096, num_hidden_layers=32, num_heads=16, intermediate_size=11008, vocab_size=32000),
    # hybrids (fla's attn config): fla's softmax Attention every few layers, GLA elsewhere (docs/hybrids.md)
    "debugmodel_hybrid": gla(hidden_size=64, num_hidden_layers=4, num_heads=4, vocab_size=2048,
                             max_position_embeddings=512, attn={"layers": [1, 3], "num_heads": 4, "num_kv_heads": 2}),
    "340M_hybrid": gla(hidden_size=1024, num_hidden_layers=24, num_heads=4, vocab_size=32000, max_position_embeddings=8192,
                       attn={"layers": [5, 11, 17, 23], "num_heads": 16, "num_kv_heads": 4}),
}
