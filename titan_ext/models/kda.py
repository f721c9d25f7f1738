"""fla's Kimi Delta Attention (``model_type "kda"``, ``KDAForCausalLM``): architecture and flavors."""

from __future__ import annotations

from titan_ext.models import mixers
from titan_ext.models.architecture import FlaArchitecture, register_architecture
from titan_ext.models.args import fla_model


@register_architecture
class KDA(FlaArchitecture):
    model_type = "kda"
    mixer = mixers.KDA
    # and the low-rank gates' down-projections and beta (num_v_heads outputs): too little work to pay for the casts
    float8_high_precision = ("f_proj", "g_proj.0", "b_proj", "lm_head")


def kda(**fields):
    return fla_model("kda", **fields)


# 1.3B is fla's KDAConfig defaults (24 layers, 16 heads of 128, hidden 2048: 1.39B parameters);
# 340M the same shape at hidden 1024 with 8 heads of 128 (387M parameters, GLA-340M's class).
kda_flavors = {
    "debugmodel": kda(
        hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=16, vocab_size=2048, max_position_embeddings=512
    ),
    "340M": kda(hidden_size=1024, num_hidden_layers=24, num_heads=8, head_dim=128, vocab_size=32000),
    "1.3B": kda(hidden_size=2048, num_hidden_layers=24, num_heads=16, head_dim=128, vocab_size=32000),
}
