"""transformers' Llama (``model_type "llama"``, Llama 3.x architecture): its flavors."""

from __future__ import annotations

from titan_ext.models.args import transformers_model


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


LLAMA_3_2_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_parameters=llama3_rope(32.0), attention_bias=False, mlp_bias=False, tie_word_embeddings=True,
)
"""Llama-3.2-1B's config.json (architecture fields); the other flavors change some of them."""


def llama(**fields):
    return transformers_model("llama", **{**LLAMA_3_2_1B, **fields})


# 1B and 3B are Llama-3.2-1B/3B, 8B is Llama-3.1-8B (their HF config.json files).
llama_flavors = {
    "debugmodel": llama(
        vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rope_parameters=llama3_rope(8.0, original_context=128),
    ),
    "1B": llama(),
    "3B": llama(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, head_dim=128),
    "8B": llama(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        rope_parameters=llama3_rope(8.0), tie_word_embeddings=False,
    ),
}
