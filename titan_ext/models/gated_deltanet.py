"""fla's Gated DeltaNet (``model_type "gated_deltanet"``): architecture and flavors."""

from __future__ import annotations

from titan_ext.kernels.state_passing import AffineState
from titan_ext.models.architecture import FlaArchitecture, register_architecture
from titan_ext.models.args import fla_model


@register_architecture
class GatedDeltaNet(FlaArchitecture):
    model_type = "gated_deltanet"
    cp_kernels = {"chunk_gated_delta_rule": AffineState(), "fused_recurrent_gated_delta_rule": AffineState()}

    def mixer_flops_per_token(self, config, seq_len):
        """The chunked gated delta rule, per layer and token, forward (training is 3x).

        Per value head, with key dim K, value dim V and chunk C (64, fla's):
        the in-chunk key-key and query-key scores cost 2 * 2*C*K; applying the
        chunk's triangular inverse to the beta-scaled keys and values, 2*C*(K + V);
        the scores times the corrections, 2*C*V; reading the state (queries
        and keys) and updating it, 3 * 2*K*V. Linear in sequence length.
        """
        heads = config.num_v_heads or config.num_heads
        key_dim = config.head_dim
        value_dim = int(config.head_dim * config.expand_v)
        from titan_ext.kernels.gated_delta import CHUNK as chunk  # imports fla: only when counted

        per_head = 4 * chunk * key_dim + 2 * chunk * (key_dim + value_dim) + 2 * chunk * value_dim
        per_head += 6 * key_dim * value_dim
        return 3 * config.num_hidden_layers * heads * per_head


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
