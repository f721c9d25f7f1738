"""fla's softmax-attention ``TransformerForCausalLM`` as a torchtitan model.

Without the flash-attn package, attention runs through PyTorch SDPA
(``titan_ext.models.sdpa_attention``, bound into titan_ext's model only);
parameter names and math stay fla's.
"""

from __future__ import annotations

import dataclasses

from titan_ext.models.args import HFModelArgs


@dataclasses.dataclass
class TransformerModelArgs(HFModelArgs):
    model_type = "transformer"
    hf_config = "fla.models:TransformerConfig"
    hf_model = "fla.models:TransformerForCausalLM"
    cp_attention = "fla"

    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_heads: int = 16
    num_kv_heads: int | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    window_size: int | None = None
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    hidden_ratio: int | None = 4
    intermediate_size: int | None = None
    hidden_act: str = "swish"
    elementwise_affine: bool = True
    norm_eps: float = 1e-6
    fuse_norm: bool = True
    fuse_swiglu: bool = True

    def hf_config_overrides(self):
        # torchtitan computes the loss from the logits; the model must not.
        return {"fuse_cross_entropy": False, "fuse_linear_cross_entropy": False}

    def mixer_flops_per_token(self, seq_len: int) -> int:
        """Softmax attention beyond the projections: 12 * layers * heads * head_dim * seq_len.

        Per layer, head and token the forward computes q.k over the keys and
        the weighted sum of values, 2 * 2 * head_dim * keys; training is 3x.
        Keys = seq_len (the full score matrix, no causal halving, as
        torchtitan's llama3 and flame count it), or the window when smaller.
        fla's heads * head_dim is hidden_size.
        """
        keys = min(seq_len, self.window_size or seq_len)
        return 12 * self.num_hidden_layers * self.hidden_size * keys


def __getattr__(name: str):
    if name == "TransformerForTitan":  # built on first use: importing this module does not import fla
        from titan_ext.models.adapter import titan_class

        return titan_class(TransformerModelArgs)
    raise AttributeError(name)


# 340M, 1B and 7B are flame's configs/transformer_*.json (fla-hub's transformer checkpoints).
transformer_flavors = {
    "debugmodel": TransformerModelArgs(
        hidden_size=64, num_hidden_layers=2, num_heads=4, num_kv_heads=2, vocab_size=2048, max_position_embeddings=512
    ),
    "340M": TransformerModelArgs(hidden_size=1024, num_hidden_layers=24, num_heads=16, vocab_size=32000),
    "1B": TransformerModelArgs(hidden_size=2048, num_hidden_layers=24, num_heads=32, vocab_size=32000),
    "7B": TransformerModelArgs(
        hidden_size=4096,
        num_hidden_layers=32,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
        max_position_embeddings=2048,
        vocab_size=32000,
    ),
}
