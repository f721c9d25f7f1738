"""fla's Gated Linear Attention (``model_type "gla"``, ``GLAForCausalLM``): architecture and flavors."""

from __future__ import annotations

from titan_ext.kernels.gla import fla_chunk_size
from titan_ext.kernels.state_passing import DiagonalDecay
from titan_ext.models.architecture import FlaArchitecture, register_architecture
from titan_ext.models.args import fla_model


@register_architecture
class GLA(FlaArchitecture):
    model_type = "gla"
    cp_kernels = {"chunk_gla": DiagonalDecay("g"), "fused_recurrent_gla": DiagonalDecay("gk")}
    # and the low-rank gate (gk_proj.0/.1, rank 16): too little work to pay for the casts
    float8_high_precision = ("gk_proj", "lm_head")

    def document_mask_blocker(self, config):
        if config.attn_mode == "fused_chunk":
            return (
                "GLA's attn_mode 'fused_chunk' takes no cu_seqlens, so its state would cross documents; "
                "use attn_mode 'chunk' (fla's default) or turn document_mask off"
            )
        return None

    def context_parallel_blocker(self, config):
        if config.attn_mode == "fused_chunk":
            return "GLA's attn_mode 'fused_chunk' has no context-parallel path; use attn_mode 'chunk' (fla's default)"
        return super().context_parallel_blocker(config)

    def mixer_flops_per_token(self, config, seq_len):
        """Chunked GLA, per layer and token, forward (training is 3x):

        with K = key dim, V = value dim (summed over H heads) and chunk C,
        the intra-chunk scores and their product with values cost
        2*C*(K + V), and reading plus updating the K/H x V/H state per head
        costs 2 * 2*K*V/H. No softmax-attention term: cost is linear in
        sequence length.
        """
        key_dim = int(config.hidden_size * config.expand_k)
        value_dim = int(config.hidden_size * config.expand_v)
        chunk = fla_chunk_size(seq_len)
        forward = 2 * chunk * (key_dim + value_dim) + 4 * key_dim * value_dim // config.num_heads
        return 3 * config.num_hidden_layers * forward


def gla(**fields):
    return fla_model("gla", **fields)


# 340M and 1.3B follow fla-hub's gla-340M/gla-1.3B checkpoints, 7B flame's gla_7B config.
gla_flavors = {
    "debugmodel": gla(hidden_size=64, num_hidden_layers=2, num_heads=4, vocab_size=2048, max_position_embeddings=512),
    "340M": gla(hidden_size=1024, num_hidden_layers=24, num_heads=4, vocab_size=32000),
    "1.3B": gla(hidden_size=2048, num_hidden_layers=24, num_heads=4, vocab_size=32000),
    "7B": gla(hidden_size=4096, num_hidden_layers=32, num_heads=16, intermediate_size=11008, vocab_size=32000),
}
