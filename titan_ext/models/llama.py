"""transformers' ``LlamaForCausalLM`` (Llama 3.x architecture) as a torchtitan model."""

from __future__ import annotations

import dataclasses

from titan_ext.models.args import HFModelArgs


def llama3_rope(factor: float, original_context: int = 8192, theta: float = 500000.0) -> dict:
    """Llama 3.1/3.2's frequency-scaled RoPE (their original context is 8192)."""
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original_context,
    }


@dataclasses.dataclass
class LlamaModelArgs(HFModelArgs):
    model_type = "llama"
    packed_layout = "position_ids"
    cp_attention = "transformers"
    hf_config = "transformers:LlamaConfig"
    hf_model = "transformers:LlamaForCausalLM"

    vocab_size: int = 128256
    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_hidden_layers: int = 16
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    rope_parameters: dict = dataclasses.field(default_factory=lambda: llama3_rope(32.0))
    attention_bias: bool = False
    mlp_bias: bool = False

    def hf_config_overrides(self):
        # torch's fused SDPA kernels on every device; no flash-attn package needed.
        return {"attn_implementation": "sdpa"}

    def mixer_flops_per_token(self, seq_len: int) -> int:
        """Softmax attention beyond the projections: 12 * layers * heads * head_dim * seq_len.

        Per layer, head and token the forward computes q.k over seq_len keys
        and the weighted sum of seq_len values, 2 * 2 * head_dim * seq_len;
        training is 3x. The full seq_len x seq_len score matrix is counted (no
        causal halving), as torchtitan's llama3 and flame count it.
        """
        head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        return 12 * self.num_hidden_layers * self.num_attention_heads * head_dim * seq_len


def __getattr__(name: str):
    if name == "LlamaForTitan":  # built on first use: importing this module does not import transformers' Llama
        from titan_ext.models.adapter import titan_class

        return titan_class(LlamaModelArgs)
    raise AttributeError(name)


# 1B and 3B are Llama-3.2-1B/3B, 8B is Llama-3.1-8B (their HF config.json files).
llama_flavors = {
    "debugmodel": LlamaModelArgs(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters=llama3_rope(8.0, original_context=128),
        tie_word_embeddings=True,
    ),
    "1B": LlamaModelArgs(tie_word_embeddings=True),
    "3B": LlamaModelArgs(
        hidden_size=3072,
        num_hidden_layers=28,
        num_attention_heads=24,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "8B": LlamaModelArgs(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        rope_parameters=llama3_rope(8.0),
    ),
}
