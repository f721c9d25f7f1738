"""fla's Gated Linear Attention (``GLAForCausalLM``) as a torchtitan model."""

from __future__ import annotations

import dataclasses

from titan_ext.kernels.gla import fla_chunk_size
from titan_ext.models.args import HFModelArgs


@dataclasses.dataclass
class GLAModelArgs(HFModelArgs):
    model_type = "gla"
    hf_config = "fla.models:GLAConfig"
    hf_model = "fla.models:GLAForCausalLM"
    cp_kernels = (("chunk_gla", "g"), ("fused_recurrent_gla", "gk"))

    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_heads: int = 4
    num_kv_heads: int | None = None
    expand_k: float = 0.5
    expand_v: float = 1.0
    hidden_ratio: int | None = 4
    intermediate_size: int | None = None
    attn_mode: str = "chunk"
    use_short_conv: bool = False
    conv_size: int = 4
    use_output_gate: bool = True
    use_gk: bool = True
    use_gv: bool = False
    feature_map: str | None = None
    clamp_min: float | None = None
    hidden_act: str = "swish"
    norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    fuse_norm: bool = True
    fuse_swiglu: bool = True

    def hf_config_overrides(self):
        # torchtitan computes the loss from the logits; the model must not.
        return {"fuse_cross_entropy": False, "fuse_linear_cross_entropy": False}

    def document_mask_blocker(self):
        if self.attn_mode == "fused_chunk":
            return (
                "GLA's attn_mode 'fused_chunk' takes no cu_seqlens, so its state would cross documents; "
                "use attn_mode 'chunk' (fla's default) or turn document_mask off"
            )
        return None

    def context_parallel_blocker(self):
        if self.attn_mode == "fused_chunk":
            return "GLA's attn_mode 'fused_chunk' has no context-parallel path; use attn_mode 'chunk' (fla's default)"
        return super().context_parallel_blocker()

    def mixer_flops_per_token(self, seq_len: int) -> int:
        """Chunked GLA, per layer and token, forward (training is 3x):

        with K = key dim, V = value dim (summed over H heads) and chunk C,
        the intra-chunk scores and their product with values cost
        2*C*(K + V), and reading plus updating the K/H x V/H state per head
        costs 2 * 2*K*V/H. No softmax-attention term: cost is linear in
        sequence length.
        """
        key_dim = int(self.hidden_size * self.expand_k)
        value_dim = int(self.hidden_size * self.expand_v)
        chunk = fla_chunk_size(seq_len)
        forward = 2 * chunk * (key_dim + value_dim) + 4 * key_dim * value_dim // self.num_heads
        return 3 * self.num_hidden_layers * forward


def __getattr__(name: str):
    if name == "GLAForTitan":  # built on first use: importing this module does not import fla
        from titan_ext.models.adapter import titan_class

        return titan_class(GLAModelArgs)
    raise AttributeError(name)


# 340M and 1.3B follow fla-hub's gla-340M/gla-1.3B checkpoints, 7B flame's gla_7B config.
gla_flavors = {
    "debugmodel": GLAModelArgs(
        hidden_size=64, num_hidden_layers=2, num_heads=4, vocab_size=2048, max_position_embeddings=512
    ),
    "340M": GLAModelArgs(hidden_size=1024, num_hidden_layers=24, num_heads=4, vocab_size=32000),
    "1.3B": GLAModelArgs(hidden_size=2048, num_hidden_layers=24, num_heads=4, vocab_size=32000),
    "7B": GLAModelArgs(
        hidden_size=4096, num_hidden_layers=32, num_heads=16, intermediate_size=11008, vocab_size=32000
    ),
}
