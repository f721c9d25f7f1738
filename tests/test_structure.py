"""A model is known by what it holds: each layer's token mixer, the layer stack, the final norm and the head are
found from the modules, never from ``model_type``, ``layer_types`` strings or attribute names (families titan_ext's
code never names; meta-device models, milliseconds each)."""

from __future__ import annotations

import logging

import pytest
import torch

from titan_ext.models import mixers
from titan_ext.models.args import HFModelArgs
from titan_ext.models.structure import structure_of

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=256, bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=512)

FAMILIES = {
    # Mamba2, attention and an FFN-only layer, each held as ``mixer``; the final norm is ``norm_f``
    "nemotron_h": dict(num_hidden_layers=3, layers_block_type=["linear_attention", "full_attention", "mlp"],
                       mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1, chunk_size=16),
    # Mamba2 and attention side by side in every layer
    "falcon_h1": dict(num_hidden_layers=2, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
                      mamba_n_groups=1, mamba_chunk_size=16),
    # a short convolution, then attention; the final norm is called ``embedding_norm``
    "lfm2": dict(num_hidden_layers=2, layer_types=["conv", "full_attention"]),
    # Qwen3.5's Gated DeltaNet under another family's name
    "qwen3_5_moe_text": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                             linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32),
    # lightning attention every other layer
    "minimax": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], num_local_experts=4,
                    num_experts_per_tok=2),
    # GPT-2's names: ``transformer.h``, ``ln_f``, ``wte``
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4),
}
EXPECTED = {
    "nemotron_h": ("model.layers", "model.norm_f", [("transformers' mamba2", "mixer"), ("transformers attention", "mixer"),
                                                   ("no mixer (FFN only)", "")]),
    "falcon_h1": ("model.layers", "model.final_layernorm", [("transformers attention + unknown mixer", "self_attn+mamba")] * 2),
    "lfm2": ("model.layers", "model.embedding_norm", [("transformers' short convolution", "conv"),
                                                      ("transformers attention", "self_attn")]),
    "qwen3_5_moe_text": ("model.layers", "model.norm", [("transformers' gated deltanet", "linear_attn"),
                                                       ("transformers attention", "self_attn")]),
    "minimax": ("model.layers", "model.norm", [("transformers' lightning attention", "self_attn"),
                                              ("transformers attention", "self_attn")]),
    "gpt2": ("transformer.h", "transformer.ln_f", [("transformers attention", "attn")] * 2),
}


def meta(model_type: str, **fields):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**(SMALL if model_type != "gpt2" else {"vocab_size": 256}), **fields})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_each_part_is_found_from_what_the_model_holds(model_type):
    structure = structure_of(meta(model_type, **FAMILIES[model_type]))
    layers, norm, expected = EXPECTED[model_type]
    assert (structure.layers, structure.final_norm) == (layers, norm)
    assert [(m.name, m.path) for m in structure.mixers] == expected


def test_a_known_layout_under_any_name_runs_titan_ext_forward():
    """Qwen3.5-MoE's Gated DeltaNet is Qwen3.5's by what it holds and calls: the model titan_ext trains runs
    titan_ext's forward for it (documents, TP shares, CP), as for Qwen3.5's."""
    from titan_ext.kernels.transformers_gated_deltanet import qwen3_5_forward
    from titan_ext.models.adapter import meta_model

    args = HFModelArgs(library="transformers", config={"model_type": "qwen3_5_moe_text", **SMALL,
                                                       **FAMILIES["qwen3_5_moe_text"]})
    model = meta_model(args)
    assert type(model.model.layers[0].linear_attn).forward.__code__ is qwen3_5_forward.__code__


WHY = ("it calls Mamba2's kernels but holds buffers mup_vector; has no MambaRMSNormGated norm: not the Mamba2 math "
       "titan_ext computes")
"""Falcon-H1's mixer beside transformers' Mamba2 (``TransformersMamba2.near_miss``)."""


def test_what_needs_an_unknown_mixers_insides_is_refused_in_one_line(caplog):
    """Falcon-H1's Mamba2 mixer (μP multipliers: not titan_ext's ``TransformersMamba2``) beside its attention."""
    args = HFModelArgs(library="transformers", config={"model_type": "falcon_h1", **SMALL, **FAMILIES["falcon_h1"]})
    reason = ("layer 0's token mixer 'mamba' (transformers.models.falcon_h1.modeling_falcon_h1.FalconH1Mixer) "
              "is not one titan_ext knows ({why}), so it has no {what}; {fix}, or register a mixer for it "
              "(docs/extending.md)").replace("{why}", WHY)
    assert args.context_parallel_blocker() == reason.format(what="context-parallel path", fix="set the degree to 1")
    assert args.document_mask_blocker() == reason.format(what="packed-document path", fix="turn document_mask off")
    from titan_ext.models.adapter import meta_model

    model = meta_model(args)
    with caplog.at_level(logging.WARNING):
        _, flops = args.get_nparams_and_flops(model, 64)
    assert flops > 0 and [r.getMessage() for r in caplog.records] == [
        "titan_ext: no FLOP count beyond their weights for the token mixers of layers [0, 1] (transformers attention + "
        "unknown mixer); MFU "
        "counts 6 FLOPs per matmul weight there"]


def test_norms_and_feed_forwards_mix_no_tokens():
    """A module of vector parameters is a norm; one of linears whose forward calls no function, or a mixture of
    experts, is a feed-forward; anything else holding parameters in a layer without a known mixer is one."""
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, mixer: nn.Module):
            super().__init__()
            self.norm, self.mix, self.ffn = nn.LayerNorm(8), mixer, nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))

    assert isinstance(mixers.recognize(Block(nn.Conv1d(8, 8, 3))), mixers.Unknown)
    assert mixers.recognize(Block(nn.Conv1d(8, 8, 3))).path == "mix"
    two_linears = mixers.recognize(Block(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))))
    assert isinstance(two_linears, mixers.Parallel) and {p.path for p in two_linears.parts} == {"mix", "ffn"}
