"""The config.json of real checkpoints is accepted, field for field, and builds the model it describes.

Each file below is written out as its checkpoint on the Hugging Face Hub ships it (written by the
transformers release named in it): keys the config class declares, keys its modeling code reads only
through ``getattr`` (Qwen3-MoE's ``head_dim``), and keys earlier releases wrote that nothing reads
today (Qwen3-Next's ``use_sliding_window``). No download: the files are data of this test.
"""

from __future__ import annotations

import copy
import logging

import pytest

from titan_ext.errors import ConfigError
from titan_ext.inputs import hf_config
from titan_ext.models.args import HFModelArgs

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip

QWEN3_NEXT_80B_A3B = {
    "architectures": ["Qwen3NextForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "full_attention_interval": 4,
    "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
    "mlp_only_layers": [], "model_type": "qwen3_next", "moe_intermediate_size": 512, "norm_topk_prob": True,
    "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
    "num_key_value_heads": 2, "output_router_logits": False, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 10000000, "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.57.0.dev0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip

OLMOE_1B_7B = {
    "architectures": ["OlmoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "clip_qkv": None,
    "eos_token_id": 50279, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 1024, "max_position_embeddings": 4096, "model_type": "olmoe", "norm_topk_prob": False,
    "num_attention_heads": 16, "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 16,
    "num_key_value_heads": 16, "output_router_logits": False, "pad_token_id": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 50304,
}  # fmt: skip

LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256,
}  # fmt: skip

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}  # fmt: skip

GLA_340M = {  # fla-hub/gla-340M-15B
    "architectures": ["GLAForCausalLM"], "attn_mode": "chunk", "bos_token_id": 1, "clamp_min": None, "conv_size": 4,
    "elementwise_affine": True, "eos_token_id": 2, "expand_k": 0.5, "expand_v": 1, "feature_map": None,
    "fuse_cross_entropy": True, "fuse_norm": True, "hidden_act": "swish", "hidden_ratio": 4, "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": None, "max_position_embeddings": 2048, "model_type": "gla",
    "norm_eps": 1e-06, "num_heads": 4, "num_hidden_layers": 24, "num_kv_heads": None, "tie_word_embeddings": False,
    "torch_dtype": "float32", "transformers_version": "4.44.0", "use_cache": True, "use_gk": True, "use_gv": False,
    "use_output_gate": True, "use_short_conv": False, "vocab_size": 32000,
}  # fmt: skip

REAL = {
    "Qwen3-30B-A3B": ("transformers", QWEN3_30B_A3B),
    "Qwen3-Next-80B-A3B": ("transformers", QWEN3_NEXT_80B_A3B),
    "OLMoE-1B-7B": ("transformers", OLMOE_1B_7B),
    "Llama-3.2-1B": ("transformers", LLAMA_3_2_1B),
    "Qwen3-0.6B": ("transformers", QWEN3_0_6B),
    "GLA-340M": ("fla", GLA_340M),
}
SOURCE = "--titan_ext.hf_config='config.json'"


def _args(library: str, config: dict) -> HFModelArgs:
    args = HFModelArgs(library=library)
    args.update_from_hf_config(copy.deepcopy(config), SOURCE)
    return args


@pytest.mark.parametrize("name", list(REAL))
def test_real_config_json_is_accepted_without_a_word(name, caplog):
    library, config = REAL[name]
    with caplog.at_level(logging.WARNING):
        args = _args(library, config)
    assert not [r for r in caplog.records if "ignored" in r.getMessage()], caplog.text
    built = args.to_hf_config()
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "head_dim", "num_experts", "num_experts_per_tok"):
        if key in config:
            assert getattr(built, key) == config[key], key


def test_head_dim_read_through_getattr_reaches_the_model():
    """Qwen3-30B-A3B: 32 heads x head_dim 128 = 4096, not hidden_size 2048 (what the model would get without it)."""
    from titan_ext.models.adapter import meta_model

    small = {**QWEN3_30B_A3B, "num_hidden_layers": 1, "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 64}
    model = meta_model(_args("transformers", small))
    assert model.model.layers[0].self_attn.q_proj.out_features == 32 * 128


def test_typo_of_a_modeling_read_key_is_one_line_naming_it():
    with pytest.raises(ConfigError, match=r"unknown key 'head_dims'.*rename it to 'head_dim'"):
        _args("transformers", {**QWEN3_30B_A3B, "head_dims": 128})
    with pytest.raises(ConfigError, match=r"unknown key 'num_expert_per_tok'.*rename it to 'num_experts_per_tok'"):
        _args("transformers", {**OLMOE_1B_7B, "num_expert_per_tok": 8})


def test_other_unknown_key_is_one_warning_line(caplog):
    with caplog.at_level(logging.WARNING):
        _args("transformers", {**QWEN3_30B_A3B, "zzz_frobnicate": 1})
    lines = [r.getMessage() for r in caplog.records if "zzz_frobnicate" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "ignored" in lines[0], lines


def test_modeling_reads_finds_getattr_keys():
    from transformers import OlmoeConfig, Qwen3MoeConfig

    assert "head_dim" in hf_config.modeling_reads(Qwen3MoeConfig)
    assert {"head_dim", "sliding_window"} <= hf_config.modeling_reads(OlmoeConfig)


def test_shipped_qwen3_30b_a3b_config_is_the_checkpoints():
    """train_configs/qwen3_30b_a3b.json (the GPU TOML's architecture) is Qwen3-30B-A3B's config.json."""
    import json
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[1] / "train_configs" / "qwen3_30b_a3b.json"
    assert json.loads(shipped.read_text()) == QWEN3_30B_A3B
