"""The config.json of real checkpoints is accepted, field for field, and builds the model it describes.

Each file below is written out as its checkpoint on the Hugging Face Hub ships it (written by the
transformers release named in it): keys the config class declares, keys its modeling code reads only
through ``getattr`` (Qwen3-MoE's ``head_dim``), keys the class takes out of its keyword arguments (Kimi
Linear's ``linear_attn_config``), and keys nothing reads (the authors' own code's, generation's, earlier
releases'): those are named in one warning line, never refused. No download: the files are data of this test.
"""

from __future__ import annotations

import copy
import logging
import re

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

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip

KIMI_LINEAR_48B_A3B = {
    "architectures": ["KimiLinearForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig", "AutoModel": "modeling_kimi.KimiLinearModel",
                 "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"},
    "bos_token_id": 163584, "dtype": "bfloat16", "eos_token_id": 163586, "first_k_dense_replace": 1, "head_dim": 72,
    "hidden_act": "silu", "hidden_size": 2304, "initializer_range": 0.02, "intermediate_size": 9216,
    "kv_lora_rank": 512,
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
                           "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                           "num_heads": 32, "short_conv_kernel_size": 4},
    "mla_use_nope": True, "model_max_length": 1048576, "model_type": "kimi_linear", "moe_intermediate_size": 1024,
    "moe_layer_freq": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_attention_heads": 32,
    "num_expert_group": 1, "num_experts": 256, "num_experts_per_token": 8, "num_hidden_layers": 27,
    "num_key_value_heads": 32, "num_nextn_predict_layers": 0, "num_shared_experts": 1, "pad_token_id": 163839,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "routed_scaling_factor": 2.446, "tie_word_embeddings": False,
    "topk_group": 1, "transformers_version": "4.56.2", "use_cache": True, "v_head_dim": 128, "vocab_size": 163840,
}  # fmt: skip

GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"],
                            "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}  # fmt: skip

PHI_3_MINI_4K = {
    "_name_or_path": "Phi-3-mini-4k-instruct", "architectures": ["Phi3ForCausalLM"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config",
                 "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
    "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 4096, "model_type": "phi3",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.2", "use_cache": True, "attention_bias": False,
    "vocab_size": 32064,
}  # fmt: skip

PHI_4 = {
    "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 100257,
    "embd_pdrop": 0.0, "eos_token_id": 100265, "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02,
    "intermediate_size": 17920, "max_position_embeddings": 16384, "model_type": "phi3", "num_attention_heads": 40,
    "num_hidden_layers": 40, "num_key_value_heads": 10, "original_max_position_embeddings": 16384,
    "pad_token_id": 100349, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 250000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.47.0", "use_cache": True, "vocab_size": 100352,
}  # fmt: skip

GEMMA_2_2B = {
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02,
    "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8,
    "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32",
    "transformers_version": "4.42.4", "use_cache": True, "vocab_size": 256000,
}  # fmt: skip

GEMMA_3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144,
}  # fmt: skip

LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}  # fmt: skip

SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
    "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 576, "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536, "is_llama_config": True, "max_position_embeddings": 8192, "model_type": "llama",
    "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_interleaved": False, "rope_scaling": None, "rope_theta": 100000,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True,
    "vocab_size": 49152,
}  # fmt: skip

MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000,
}  # fmt: skip

MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0",
    "use_cache": True, "vocab_size": 32000,
}  # fmt: skip

QWEN2_5_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": True, "use_mrope": False, "use_sliding_window": False,
    "vocab_size": 152064,
}  # fmt: skip

QWEN1_5_MOE_A2_7B = {
    "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
    "model_type": "qwen2_moe", "moe_intermediate_size": 1408, "norm_topk_prob": False, "num_attention_heads": 16,
    "num_experts": 60, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 5632, "sliding_window": 32768, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.39.0.dev0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip

GRANITE_3_0_2B = {
    "architectures": ["GraniteForCausalLM"], "attention_bias": False, "attention_dropout": 0.1,
    "attention_multiplier": 0.015625, "bos_token_id": 0, "embedding_multiplier": 12.0, "eos_token_id": 0,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "logits_scaling": 8.0, "max_position_embeddings": 4096, "mlp_bias": False, "model_type": "granite",
    "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8, "pad_token_id": 0,
    "residual_multiplier": 0.22, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.46.0.dev0",
    "use_cache": True, "vocab_size": 49155,
}  # fmt: skip

OLMO_2_7B = {
    "architectures": ["Olmo2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "eos_token_id": 100257,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008,
    "max_position_embeddings": 4096, "model_type": "olmo2", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 32, "pad_token_id": 100277, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 500000, "tie_word_embeddings": False, "torch_dtype": "float32",
    "transformers_version": "4.47.0.dev0", "use_cache": True, "vocab_size": 100352,
}  # fmt: skip

STABLELM_2_1_6B = {
    "architectures": ["StableLmForCausalLM"], "bos_token_id": 100257, "eos_token_id": 100257, "hidden_act": "silu",
    "hidden_dropout": 0.0, "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5632,
    "layer_norm_eps": 1e-05, "max_position_embeddings": 4096, "model_type": "stablelm", "num_attention_heads": 32,
    "num_hidden_layers": 24, "num_key_value_heads": 32, "partial_rotary_factor": 0.25, "qk_layernorm": False,
    "rope_scaling": None, "rope_theta": 10000, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.38.0", "use_cache": True, "use_parallel_residual": False, "use_qkv_bias": True,
    "vocab_size": 100352,
}  # fmt: skip

COMMAND_R = {
    "architectures": ["CohereForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 5,
    "eos_token_id": 255001, "hidden_act": "silu", "hidden_size": 8192, "initializer_range": 0.02,
    "intermediate_size": 22528, "layer_norm_eps": 1e-05, "logit_scale": 0.0625, "max_position_embeddings": 8192,
    "model_type": "cohere", "num_attention_heads": 64, "num_hidden_layers": 40, "num_key_value_heads": 64,
    "pad_token_id": 0, "rope_theta": 8000000.0, "torch_dtype": "float16", "transformers_version": "4.38.2",
    "use_cache": True, "use_qk_norm": False, "vocab_size": 256000,
}  # fmt: skip

GLM_4_9B_0414 = {
    "architectures": ["Glm4ForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 13696, "max_position_embeddings": 32768, "model_type": "glm4",
    "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 2, "pad_token_id": 151329,
    "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.52.0.dev0", "use_cache": True, "vocab_size": 151552,
}  # fmt: skip

REAL = {
    "Qwen3-30B-A3B": ("transformers", QWEN3_30B_A3B),
    "Qwen3-Next-80B-A3B": ("transformers", QWEN3_NEXT_80B_A3B),
    "OLMoE-1B-7B": ("transformers", OLMOE_1B_7B),
    "Llama-3.2-1B": ("transformers", LLAMA_3_2_1B),
    "Qwen3-0.6B": ("transformers", QWEN3_0_6B),
    "GLA-340M": ("fla", GLA_340M),
    "DeepSeek-V3": ("transformers", DEEPSEEK_V3),
    "Kimi-Linear-48B-A3B-Instruct": ("transformers", KIMI_LINEAR_48B_A3B),
    "gpt-oss-20b": ("transformers", GPT_OSS_20B),
    "Phi-3-mini-4k-instruct": ("transformers", PHI_3_MINI_4K),
    "phi-4": ("transformers", PHI_4),
    "gemma-2-2b": ("transformers", GEMMA_2_2B),
    "gemma-3-1b-pt": ("transformers", GEMMA_3_1B),
    "Llama-3.1-8B": ("transformers", LLAMA_3_1_8B),
    "SmolLM2-135M": ("transformers", SMOLLM2_135M),
    "Mistral-7B-v0.1": ("transformers", MISTRAL_7B),
    "Mixtral-8x7B-v0.1": ("transformers", MIXTRAL_8X7B),
    "Qwen2.5-7B": ("transformers", QWEN2_5_7B),
    "Qwen1.5-MoE-A2.7B": ("transformers", QWEN1_5_MOE_A2_7B),
    "granite-3.0-2b-base": ("transformers", GRANITE_3_0_2B),
    "OLMo-2-1124-7B": ("transformers", OLMO_2_7B),
    "stablelm-2-1_6b": ("transformers", STABLELM_2_1_6B),
    "c4ai-command-r-v01": ("transformers", COMMAND_R),
    "GLM-4-9B-0414": ("transformers", GLM_4_9B_0414),
}

# What nothing reads in each file (transformers 5.24): the authors' own code's keys (DeepSeek-V3's ``ep_size``,
# ``scoring_func``: transformers' modeling hard-codes sigmoid routing), generation's (``cache_implementation``),
# the weights' storage (``quantization_config``), spellings of other releases (gpt-oss's ``experts_per_token``
# beside the ``num_experts_per_tok`` read, Gemma 2's ``hidden_act`` beside ``hidden_activation``).
UNREAD = {
    "Qwen3-30B-A3B": ["max_window_layers"],
    "Qwen3-Next-80B-A3B": ["use_sliding_window"],
    "DeepSeek-V3": ["aux_loss_alpha", "ep_size", "moe_layer_freq", "quantization_config", "scoring_func", "seq_aux",
                    "topk_method"],
    "Kimi-Linear-48B-A3B-Instruct": ["mla_use_nope", "moe_layer_freq", "moe_router_activation_func",
                                     "num_nextn_predict_layers"],
    "gpt-oss-20b": ["experts_per_token", "initial_context_length", "quantization_config"],
    "Phi-3-mini-4k-instruct": ["attention_bias"],
    "phi-4": ["attention_bias"],
    "gemma-2-2b": ["cache_implementation", "hidden_act"],
    "gemma-3-1b-pt": ["cache_implementation"],
    "SmolLM2-135M": ["is_llama_config", "rope_interleaved"],
    "Qwen2.5-7B": ["use_mrope"],
}  # fmt: skip
SOURCE = "--titan_ext.hf_config='config.json'"


def _args(library: str, config: dict) -> HFModelArgs:
    args = HFModelArgs(library=library)
    args.update_from_hf_config(copy.deepcopy(config), SOURCE)
    return args


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and SOURCE in r.getMessage()]


def _named(line: str) -> list[str]:
    """The keys a warning line names (quoted)."""
    return re.findall(r"'(\w+)'", line.split(SOURCE, 1)[1])


@pytest.mark.parametrize("name", list(REAL))
def test_real_config_json_plans_and_names_only_the_keys_nothing_reads(name, caplog):
    library, config = REAL[name]
    with caplog.at_level(logging.WARNING):
        args = _args(library, config)
    lines = _warnings(caplog)
    if name in UNREAD:
        assert len(lines) == 1 and _named(lines[0]) == UNREAD[name], lines
    else:
        assert lines == [], lines
    built = args.to_hf_config()
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "num_experts", "num_experts_per_tok",
                "n_routed_experts", "num_local_experts"):
        if key in config:
            assert getattr(built, key) == config[key], key
    assert len(args.layer_mixers()) == config["num_hidden_layers"]  # the model built on the meta device


def test_head_dim_read_through_getattr_reaches_the_model():
    """Qwen3-30B-A3B: 32 heads x head_dim 128 = 4096, not hidden_size 2048 (what the model would get without it)."""
    from titan_ext.models.adapter import meta_model

    small = {**QWEN3_30B_A3B, "num_hidden_layers": 1, "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 64}
    model = meta_model(_args("transformers", small))
    assert model.model.layers[0].self_attn.q_proj.out_features == 32 * 128


def test_kimi_linear_layers_follow_its_linear_attn_config():
    """``linear_attn_config`` (1-indexed full-attention layers 4, 8, ..., 24, 27) is read, not ignored: the
    class's own default would put full attention at layers 4, 8, ... 24 only (0-indexed multiples of 4)."""
    args = _args("transformers", KIMI_LINEAR_48B_A3B)
    full = {i for i, kind in enumerate(args.to_hf_config().layer_types) if kind == "full_attention"}
    assert full == {3, 7, 11, 15, 19, 23, 26}
    mixers = args.layer_mixers()
    assert {i for i, mixer in enumerate(mixers) if mixer.name == "transformers mla"} == full
    assert args.to_hf_config().mlp_layer_types[:2] == ["dense", "sparse"]  # first_k_dense_replace, also a kwarg


def test_gemma_3_layers_follow_its_sliding_window_pattern():
    built = _args("transformers", {**GEMMA_3_1B, "sliding_window_pattern": 3}).to_hf_config()
    assert built.layer_types[:6] == ["sliding_attention", "sliding_attention", "full_attention"] * 2


def test_a_misspelled_key_is_named_in_the_one_warning_line_and_never_refused(caplog):
    with caplog.at_level(logging.WARNING):
        args = _args("transformers", {**QWEN3_30B_A3B, "head_dims": 64, "num_expert_per_tok": 2})
    lines = _warnings(caplog)
    assert len(lines) == 1 and "\n" not in lines[0] and "ignored" in lines[0], lines
    assert _named(lines[0]) == ["max_window_layers", "head_dims", "num_expert_per_tok"]
    assert args.to_hf_config().head_dim == 128 and args.to_hf_config().num_experts_per_tok == 8


def test_a_value_that_cannot_work_is_still_one_line():
    with pytest.raises(ConfigError, match=r"num_attention_heads=32 is not divisible by num_key_value_heads=5"):
        _args("transformers", {**MIXTRAL_8X7B, "num_key_value_heads": 5})
    with pytest.raises(ConfigError, match=r"hidden_size='2880' has type str, hidden_size needs int"):
        _args("transformers", {**GPT_OSS_20B, "hidden_size": "2880"})


def test_modeling_reads_finds_getattr_keys():
    from transformers import OlmoeConfig, Qwen3MoeConfig

    assert "head_dim" in hf_config.modeling_reads(Qwen3MoeConfig)
    assert {"head_dim", "sliding_window"} <= hf_config.modeling_reads(OlmoeConfig)


def test_config_reads_finds_the_keys_a_class_takes_from_its_keyword_arguments():
    from transformers import Gemma3TextConfig, KimiLinearConfig

    assert {"linear_attn_config", "first_k_dense_replace"} <= hf_config.config_reads(KimiLinearConfig)
    assert "sliding_window_pattern" in hf_config.config_reads(Gemma3TextConfig)
    assert "linear_attn_config" not in hf_config.config_reads(Gemma3TextConfig)


def test_shipped_qwen3_30b_a3b_config_is_the_checkpoints():
    """train_configs/qwen3_30b_a3b.json (the GPU TOML's architecture) is Qwen3-30B-A3B's config.json."""
    import json
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[1] / "train_configs" / "qwen3_30b_a3b.json"
    assert json.loads(shipped.read_text()) == QWEN3_30B_A3B
