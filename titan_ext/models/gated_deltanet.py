"""fla's Gated DeltaNet (``model_type "gated_deltanet"``): architecture and flavors."""

from __future__ import annotations

from titan_ext.models import mixers
from titan_ext.models.architecture import FlaArchitecture, register_architecture
from titan_ext.models.args import fla_model


@register_architecture
class GatedDeltaNet(FlaArchitecture):
    model_type = "gated_deltanet"
    mixer = mixers.GatedDeltaNet


def gated_deltanet(**fields):
    return fla_model("gated_deltanet", **fields)


# 340M is flame's configs/gated_deltanet_340M.json (512M parameters counted here: its keys are 1.5x and its
# values 3x the width, where the name counts GLA-like ones); 1.3B is fla's GatedDeltaNetConfig defaults
# (the Gated DeltaNet paper's 1.3B: 21 layers, 6 heads of 256, values expanded 2x).
gated_deltanet_flavors = {
    "debugmodel": gated_deltanet(
        hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=16, vocab_size=2048, max_position_embeddings=512
    ),
    "340M": gated_deltanet(
        hidden_size=1024, num_hidden_layers=21, num_heads=6, head_dim=256, expand_v=2.0, vocab_size=32000
    ),
    "1.3B": gated_deltanet(
        hidden_size=2048, num_hidden_layers=21, num_heads=6, head_dim=256, expand_v=2.0, vocab_size=32000
    ),
}
