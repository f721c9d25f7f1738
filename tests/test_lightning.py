"""transformers' lightning attention (MiniMax's ``linear_attention`` layers, ``models.mixers.lightning``): recognised
by what the module holds, its titan_ext forward (fla's simple GLA contract) equal to transformers' own block-decay
forward, each packed document from zero state. Training under TP and CP against one process is the integration
matrix's (``hf_minimax``); the scalar decay's state passing alone, tests/test_state_passing.py (``simple_gla``)."""

import torch
from helpers import assert_documents_restart

from titan_ext.models import mixers
from titan_ext.models.adapter import build_model
from titan_ext.models.args import transformers_model

MINIMAX = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention"],
               num_local_experts=2, num_experts_per_tok=1, block_size=16, tie_word_embeddings=False)
"""Blocks of 16 tokens: transformers' forward crosses several, the last one partial."""


def minimax(**fields):
    return transformers_model("minimax", **{**MINIMAX, **fields})


def test_minimax_linear_attention_layers_are_known_by_what_they_hold():
    model = build_model(minimax())
    lightning, attention = model.mixers
    assert type(lightning).__name__ == "TransformersLightningAttention" and lightning.path == "self_attn"
    assert isinstance(attention, mixers.TransformersAttention)
    assert lightning.context_parallel_blocker(model.config, 0) is None
    assert lightning.flops_per_token(model.config, 0, 40) == 3 * 4 * (4 * 64 * 16 + 4 * 16 * 16)


def test_titan_ext_forward_equals_transformers():
    """titan_ext's model runs its own forward of the layer (``kernels.transformers_lightning``: simple GLA on the
    portable kernel, chunks of 64); transformers' model its own (blocks of 16, its decay buffers): equal in fp64,
    logits and every gradient."""
    from transformers import AutoModelForCausalLM

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = build_model(minimax())
        model.init_weights()
        assert type(model.model.layers[0].self_attn).forward.__name__ == "minimax_forward"
        reference = AutoModelForCausalLM.from_config(model.config)
        reference.load_state_dict(model.state_dict())
        for each in (model, reference):  # torch's grouped_mm takes no fp64
            each.set_experts_implementation("eager")
        tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
        ours, theirs = model(tokens), reference(tokens, use_cache=False).logits
        ours.sum().backward()
        theirs.sum().backward()
    finally:
        torch.set_default_dtype(torch.float32)
    assert torch.allclose(ours, theirs, rtol=1e-9, atol=1e-9)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad - q.grad).norm() <= 1e-9 * q.grad.norm(), name


def test_documents_restart_the_state():
    """With document masking (as a job applies it: per-document attention, ``cu_seq_lens_q``) each packed
    document's logits equal the document's alone: the lightning attention's state restarts at every document."""
    torch.manual_seed(0)
    model = build_model(minimax())
    model.init_weights()
    assert_documents_restart(model, 40, [0, 15, 16, 29], mixed_from=16)  # a 1-token document
