"""fla's ``GatedLinearAttention`` (``fla.layers.gla``)."""

from __future__ import annotations

from titan_ext.kernels.gla import fla_chunk_size
from titan_ext.kernels.state_passing import DiagonalDecay
from titan_ext.models.mixers.base import Mixer


class GLA(Mixer):
    name = "gla"
    classes = ("fla.layers.gla:GatedLinearAttention",)
    tp_plan = "gla"
    cp_kernels = {"chunk_gla": DiagonalDecay("g"), "fused_recurrent_gla": DiagonalDecay("gk")}

    def document_mask_blocker(self, config, layer):
        if config.attn_mode == "fused_chunk":
            return (
                "GLA's attn_mode 'fused_chunk' takes no cu_seqlens, so its state would cross documents; "
                "use attn_mode 'chunk' (fla's default) or turn document_mask off"
            )
        return None

    def context_parallel_blocker(self, config, layer):
        if config.attn_mode == "fused_chunk":
            return "GLA's attn_mode 'fused_chunk' has no context-parallel path; use attn_mode 'chunk' (fla's default)"
        return None

    def flops_per_token(self, config, layer, seq_len):
        """Chunked GLA, per token, forward (training is 3x):

        with K = key dim, V = value dim (summed over H heads) and chunk C,
        the intra-chunk scores and their product with values cost
        2*C*(K + V), and reading plus updating the K/H x V/H state per head
        costs 2 * 2*K*V/H. No softmax-attention term: cost is linear in
        sequence length.
        """
        key_dim = int(config.hidden_size * config.expand_k)
        value_dim = int(config.hidden_size * config.expand_v)
        chunk = fla_chunk_size(seq_len)
        return 3 * (2 * chunk * (key_dim + value_dim) + 4 * key_dim * value_dim // config.num_heads)
