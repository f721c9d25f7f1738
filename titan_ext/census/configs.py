"""Which config the census trains each model type with: a tiny one, derived from the type's own config class.

The type's config class, shrunk the way transformers' tests shrink models (``tiny_config``): a generic pass over the
field names configs share (``GENERIC``: widths, layers, heads, MoE, MLA, Mamba/linear-attention sizes, vocabulary,
positions, dropout, token ids), per-layer lists truncated so every kind of layer the family's default names stays
(``_keep_layers``), and ``OVERRIDES`` for what the generic pass cannot know. ``check_tiny`` builds it with the type's
own causal-LM class on the meta device. Which types get one: ``model_types``.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

from titan_ext.census.model_types import fla_classes, transformers_classes

HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE = 64
VOCAB = 2048
"""The shipped tokenizer's (``titan_ext/assets/tiny``)."""
MAX_POSITIONS = 512
WINDOW = 32
"""Sliding windows, attention chunks: below the census's sequence length, so that the window is real."""
EXPERTS, TOP_K, EXPERT_INTERMEDIATE = 4, 2, 32
MAX_PARAMS = 5_000_000

_LAYER_COUNT_FIELDS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_blocks")

EXPERT_COUNTS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
"""Fields that count a mixture of experts' experts."""

GENERIC: dict[str, Any] = {
    # widths
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embedding_dim", "emb_dim", "lru_width",
                     "word_embed_proj_dim"), HIDDEN),
    # heads
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads",
                     "swa_num_attention_heads", "compressor_num_heads", "num_v_heads"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "num_query_groups", "multi_query_group_num",
                     "swa_num_key_value_heads", "kv_n_heads"), KV_HEADS),
    **dict.fromkeys(("head_dim", "attention_head_dim", "d_head", "kv_channels", "attention_head_size",
                     "head_size", "swa_head_dim", "dim_head", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_head_dim", "index_head_dim", "v_head_dim"), HEAD_DIM),
    # feed-forward
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "feed_forward_size", "dim_ff",
                     "intermediate_size_mlp", "dense_intermediate_size", "dff", "dim_fx"), INTERMEDIATE),
    # mixture of experts
    **dict.fromkeys(EXPERT_COUNTS, EXPERTS),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts", "num_experts_per_token",
                     "moe_top_k"), TOP_K),
    **dict.fromkeys(("moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size",
                     "moe_shared_expert_intermediate_size", "shared_intermediate_size",
                     "shared_experts_intermediate_size"), EXPERT_INTERMEDIATE),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "n_group", "topk_group",
                     "num_expert_group", "first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"), 1),
    "zero_expert_num": 2,
    # multi-head latent attention and sparse indexers
    "q_lora_rank": 32, "kv_lora_rank": 16, "o_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "qk_head_dim": 16, "index_n_heads": 2, "index_topk": 16,
    # linear attention, Mamba, convolutions
    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    **dict.fromkeys(("mamba_d_state", "state_size", "ssm_state_size"), 16),
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads"), 8),
    **dict.fromkeys(("mamba_d_head", "mamba_head_dim", "mamba_headdim"), 16),
    **dict.fromkeys(("mamba_n_groups", "mamba_ngroups", "n_groups"), 1),
    **dict.fromkeys(("mamba_dt_rank", "time_step_rank", "dt_rank"), 8),
    **dict.fromkeys(("mamba_chunk_size", "chunk_size"), 16),
    "mamba_d_ssm": 128,
    # vocabulary and positions
    **dict.fromkeys(("vocab_size", "vocab_size_per_layer_input", "unpadded_vocab_size"), VOCAB),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx", "context_length",
                     "max_target_positions", "model_max_length"), MAX_POSITIONS),
    # windows (kept below the census's sequence length)
    **dict.fromkeys(("sliding_window", "attention_window_size", "sliding_window_size", "local_attention_window_len",
                     "attention_chunk_size", "window_size"), WINDOW),
    # widths of per-layer inputs
    "hidden_size_per_layer_input": 16,
    "rotary_dim": 8,
}
"""Field -> tiny value, applied where the config's default is a number (a ``None`` default stays: the feature is
off, e.g. no ``q_lora_rank``). Integers only shrink: a default below the tiny value is kept."""

_KV_HEADS = {"num_key_value_heads", "num_kv_heads", "kv_n_heads"}
_KEEP_IF_ONE = _KV_HEADS
"""Multi-query attention (one kv head) stays multi-query."""
_FILL_NONE = {"head_dim", "num_key_value_heads", "num_kv_heads"}
"""Set even where the default is None (derived from other fields, or read as is by some modeling files)."""
_ONLY_SHRINK = {
    "num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts",
    "num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts", "num_experts_per_token", "moe_top_k",
    "n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "n_group", "topk_group", "num_expert_group",
    "first_k_dense_replace", "num_dense_layers", "moe_layer_start_index", "zero_expert_num", "rotary_dim",
    "mamba_n_groups", "mamba_ngroups", "n_groups",
}
"""Counts a family may keep below the tiny value (top-1 routing, no shared expert, no dense prefix)."""

_HEAD_KEYS = {"num_heads", "num_attention_heads", "head_dim"}
_NOISE = ("router_jitter_noise", "input_jitter_noise")

OVERRIDES: dict[str, dict[str, Any]] = {
    # what the generic pass cannot know (a default that does not build or train, sizes tied by a formula, a
    # per-layer pattern derived from other fields); ``_LAYERS`` sets the number of layers where the family
    # derives its pattern from other fields
    "bamba": {"_LAYERS": 4, "attn_layer_indices": [2]},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    "deepseek_v2": {"num_experts_per_tok": TOP_K, "n_group": 1, "topk_group": 1},
    "dory": {"_LAYERS": 4, "layer_types": ["sliding_attention"] * 3 + ["full_attention"], "n_input_layers": 1,
             "n_recurrent_layers": 2, "n_output_layers": 1,
             "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}},
    "dots1": {"n_routed_experts": EXPERTS, "num_experts_per_tok": TOP_K, "n_shared_experts": 1},
    "gemma3n_text": {"_LAYERS": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
                     "num_kv_shared_layers": 2, "intermediate_size": [INTERMEDIATE] * 4,
                     "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0], "laurel_rank": 8},
    "granitemoehybrid": {"_LAYERS": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"]},
    "jamba": {"_LAYERS": 4, "attn_layer_period": 4, "attn_layer_offset": 2, "expert_layer_period": 2,
              "expert_layer_offset": 1},
    "lfm2": {"_LAYERS": 4, "layer_types": ["conv", "conv", "full_attention", "conv"], "full_attn_idxs": [2]},
    "lfm2_moe": {"_LAYERS": 4, "layer_types": ["conv", "conv", "full_attention", "conv"]},
    "mamba2": {"num_heads": 8, "head_dim": 16},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM,
                       "indexer_budget": 16, "indexer_compress_ratio": 4, "hc_lowrank": 8, "ple_embed_dim": HIDDEN,
                       "ngram_vocab_size_base": 256, "make_ngram_vocab_size_divisible_by": 8},
    "recurrent_gemma": {"_LAYERS": 3},
    "reformer": {"is_decoder": True, "axial_pos_shape": [8, 8], "axial_pos_embds_dim": [32, 32],
                 "local_attn_chunk_length": 16, "lsh_attn_chunk_length": 16, "num_buckets": 4,
                 "max_position_embeddings": 64},
    "rwkv": {"attention_hidden_size": HIDDEN},
    "zamba": {"_LAYERS": 4, "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"], "attn_layer_period": 2,
              "attn_layer_offset": 1, "attention_hidden_size": 2 * HIDDEN, "n_mamba_heads": 2},
    "zamba2": {"_LAYERS": 4, "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"], "hybrid_layer_ids": [1, 3],
               "attention_hidden_size": 2 * HIDDEN, "n_mamba_heads": 2, "mamba_headdim": HIDDEN, "adapter_rank": 8},
    # fla
    "hgrn2": {"expand_ratio": 16},
    "lightnet": {"expand_ratio": 16},
    "log_linear_mamba2": {"num_heads": 8, "head_dim": 16},
    "mamba3": {"num_heads": 8, "head_dim": 16},
    "rodimus": {"ska_attn": {"num_heads": HEADS, "window_size": WINDOW}},
    "yoco": {"num_self_decoder_layers": 1},
}


# ---- which config ----------------------------------------------------------------------------------

def tiny_config(model_type: str, library: str = "transformers") -> dict[str, Any]:
    """The tiny config of ``model_type`` as its ``config.json`` (what ``save_pretrained`` writes)."""
    return tiny_config_object(model_type, library).to_diff_dict()


def tiny_config_object(model_type: str, library: str = "transformers"):
    """The type's config class with the tiny fields: 2 kv heads, or as many as query heads where the family
    allows no grouped-query attention (its config or model refuses the first)."""
    config_class, model_class = (transformers_classes if library == "transformers" else fla_classes)(model_type)
    for gqa in (True, False):
        try:
            config = config_class(**shrink(config_class, model_type, gqa))
            if gqa:
                _build_on_meta(model_class, config, library)
            break
        except ImportError:  # a package the model needs even to be built (fla's MLA: flash-attn): no verdict
            break
        except Exception:  # noqa: BLE001  (multi-head only: the second try, whose error is the caller's)
            if not gqa:
                raise
    config.model_type = model_type  # types that share a class (exaone -> LlamaConfig) keep their own name
    return config


def shrink(config_class: type, model_type: str, gqa: bool = True) -> dict[str, Any]:
    """The constructor arguments of ``config_class``'s tiny config."""
    defaults = config_class().to_dict()
    fields = _shrink_fields(defaults, gqa)
    sub_configs = getattr(config_class, "sub_configs", None) or {}
    for key, sub in sub_configs.items():
        if isinstance(defaults.get(key), dict) and isinstance(sub, type):
            fields[key] = {**defaults[key], **_shrink_fields(defaults[key], gqa),
                           **_keep_layers(defaults[key], None)}
    for key, value in defaults.items():  # plain dicts of attention settings (fla's ``attn``, YOCO's)
        if key not in sub_configs and isinstance(value, dict) and _HEAD_KEYS & value.keys():
            fields[key] = {**value, **_shrink_fields(value, gqa)}
    overrides = dict(OVERRIDES.get(model_type, {}))
    layers = overrides.pop("_LAYERS", None)
    fields.update(_keep_layers(defaults, layers, gqa))
    for key, value in overrides.items():  # a sub-config's override merges into it
        fields[key] = {**fields[key], **value} if isinstance(value, dict) and key in sub_configs else value
    _tie_derived_dims(defaults, fields)
    return {k: v for k, v in fields.items() if k not in ("transformers_version", "model_type")}


def _shrink_fields(defaults: dict[str, Any], gqa: bool = True) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    gqa = gqa and defaults.get("kv_lora_rank") is None  # latent attention (MLA) has a kv head per query head
    for key, value in defaults.items():
        tiny = GENERIC.get(key)
        if tiny is not None and (_is_number(value) or value is None and key in _FILL_NONE):
            if key in _KEEP_IF_ONE and value == 1:
                continue
            if key in _KV_HEADS and not gqa:
                tiny = HEADS  # a family whose attention is multi-head only
            fields[key] = min(value, tiny) if key in _ONLY_SHRINK and value is not None else tiny
        elif _is_dropout(key) and _is_number(value) and value:
            fields[key] = 0.0
        elif key in _NOISE and _is_number(value) and value:
            fields[key] = 0.0
        elif key.endswith(("_token_id", "_token_ids", "_token_index")) and value is not None:
            fields[key] = _small_token_id(key, value)
    if defaults.get("moe_layer_end_index") is not None:
        fields["moe_layer_end_index"] = -1  # set with the layer count (``_keep_layers``)
    return fields


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_dropout(key: str) -> bool:
    return "dropout" in key or "pdrop" in key or key.endswith(("drop_prob", "layerdrop", "dropout_p"))


_TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _small_token_id(key: str, value):
    """bos 1, eos 2, pad 0; any other special token id a small one of its own, inside the tiny vocabulary."""
    if isinstance(value, list):
        return [_small_token_id(key, v) for v in value[:1]] if key == "eos_token_id" else \
            [_small_token_id(key, v) for v in value]
    if key in _TOKEN_IDS:
        return _TOKEN_IDS[key]
    if isinstance(value, int) and value >= 16:
        return 3 + sum(map(ord, key)) % 13  # stable, distinct enough for the tiny models' embeddings
    return value


_INDEX_LISTS = ("moe_layers", "full_attn_idxs", "hybrid_layer_ids", "mlp_only_layers", "attn_layer_indices",
                "local_layer_ids")
"""Fields holding layer indices (not one entry per layer)."""


def _layer_count(defaults: dict[str, Any]) -> tuple[str | None, int | None]:
    for key in _LAYER_COUNT_FIELDS:
        if _is_number(defaults.get(key)):
            return key, int(defaults[key])
    return None, None


def _keep_layers(defaults: dict[str, Any], layers: int | None, gqa: bool = True) -> dict[str, Any]:
    """The layer count and every per-layer field, truncated to the layers that keep each kind of layer the
    default names (its first occurrence), filled up to 4 in the default's order (2 for a model of one kind).

    ``layers`` (an override) sets the count where a family derives its pattern from other fields."""
    count_key, count = _layer_count(defaults)
    if count_key is None:
        return {}
    per_layer = {k: v for k, v in defaults.items()
                 if isinstance(v, list) and len(v) == count and k not in _INDEX_LISTS}
    index_lists = {k: v for k, v in defaults.items() if k in _INDEX_LISTS and isinstance(v, list)}
    attn_layers = (defaults.get("attn") or {}).get("layers") if isinstance(defaults.get("attn"), dict) else None
    if isinstance(attn_layers, list):  # fla's hybrids: the softmax-attention layers
        index_lists["attn.layers"] = attn_layers
    columns = {**per_layer, **{k: [i in v for i in range(count)] for k, v in index_lists.items()}}
    keep = sorted({[repr(x) for x in column].index(value) for column in columns.values()
                   for value in {repr(x) for x in column}})
    mixed = any(len({repr(x) for x in column}) > 1 for column in columns.values())
    target = layers or max(len(keep), 4 if mixed else 2)
    for i in range(count):
        if len(keep) >= target:
            break
        if i not in keep:
            keep = sorted({*keep, i})
    keep = keep[:max(target, len(keep))] if layers is None else list(range(min(layers, count)))
    out: dict[str, Any] = {count_key: len(keep)}
    if count_key == "num_blocks" or "num_blocks" in defaults and defaults.get("num_blocks") == count:
        out["num_blocks"] = len(keep)
    for key, column in per_layer.items():
        out[key] = [_shrink_layer_value(key, column[i]) for i in keep]
    for key, indices in index_lists.items():
        remapped = [new for new, old in enumerate(keep) if old in indices]
        if key == "attn.layers":
            out["attn"] = {**defaults["attn"], **_shrink_fields(defaults["attn"], gqa), "layers": remapped}
        else:
            out[key] = remapped
    if defaults.get("moe_layer_end_index") is not None:
        out["moe_layer_end_index"] = len(keep) - 1
    if isinstance(defaults.get("per_layer_config"), dict):
        out["per_layer_config"] = {f"{new:02d}": _shrink_fields(defaults["per_layer_config"][f"{old:02d}"], gqa)
                                   for new, old in enumerate(keep) if f"{old:02d}" in defaults["per_layer_config"]}
    return out


def _shrink_layer_value(key: str, value):
    """One layer's entry of a per-layer list: sizes shrink like the scalar field of that name."""
    if key in ("intermediate_size",) and _is_number(value):
        return INTERMEDIATE
    if key in ("num_attention_heads_per_layer",) and _is_number(value):
        return HEADS
    if key in ("value_dim",) and _is_number(value):  # fla's RWKV-7
        return HIDDEN
    return value


def _tie_derived_dims(defaults: dict[str, Any], fields: dict[str, Any]) -> None:
    """Fields whose default is another's (DeepSeek's ``head_dim`` is its ``qk_rope_head_dim``; ``qk_head_dim``
    is nope + rope) stay tied to it."""
    if "qk_rope_head_dim" in fields and defaults.get("head_dim") == defaults.get("qk_rope_head_dim"):
        fields["head_dim"] = fields["qk_rope_head_dim"]
    if {"qk_nope_head_dim", "qk_rope_head_dim"} <= fields.keys() and "qk_head_dim" in defaults:
        fields["qk_head_dim"] = fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]


def _building(library: str):
    """fla's softmax ``Attention`` refuses to be built without flash-attn; titan_ext builds it with torch's SDPA
    (``kernels.host_patches.BUILD``), as its jobs do."""
    if library != "fla":
        return contextlib.nullcontext()
    from titan_ext.kernels.host_patches import building

    return building()


def _build_on_meta(model_class: type, config, library: str):
    import torch

    with torch.device("meta"), _building(library):
        return model_class(config)


def check_tiny(model_type: str, library: str = "transformers") -> tuple[Any, int]:
    """Build the tiny config, read back from its ``config.json`` as a user's job reads it, with the type's own
    causal-LM class on the meta device: (model, parameters)."""
    config_class, model_class = (transformers_classes if library == "transformers" else fla_classes)(model_type)
    fields = copy.deepcopy(tiny_config(model_type, library))
    fields.pop("model_type", None)
    model = _build_on_meta(model_class, config_class(**fields), library)
    return model, sum(p.numel() for p in model.parameters())
