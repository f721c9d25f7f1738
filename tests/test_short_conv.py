"""transformers' gated short convolution (LFM2's ``conv`` layers, ``models.mixers.short_conv``): recognised by what
the module holds and calls, its titan_ext forward equal to transformers' own, each packed document convolved alone.
Training under TP and CP against one process is the integration matrix's (``hf_lfm2``)."""

import pytest
import torch
from helpers import assert_documents_restart

from titan_ext.models import mixers
from titan_ext.models.adapter import build_model
from titan_ext.models.args import transformers_model

LFM2 = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, layer_types=["conv", "full_attention"], conv_L_cache=4)


def lfm2(model_type="lfm2", **fields):
    extra = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_dense_layers": 2}
    return transformers_model(model_type, **LFM2, **(extra if model_type == "lfm2_moe" else {}), **fields)


@pytest.mark.parametrize("model_type", ["lfm2", "lfm2_moe"])
def test_lfm2_layers_are_known_by_what_they_hold(model_type):
    model = build_model(lfm2(model_type))
    conv, attention = model.mixers
    assert type(conv).__name__ == "TransformersShortConv" and conv.path == "conv" and conv.halo == 3
    assert isinstance(attention, mixers.TransformersAttention)
    assert conv.context_parallel_blocker(model.config, 0) is None
    assert conv.document_mask_blocker(model.config, 0) is None


def test_a_mamba_mixer_is_no_short_convolution():
    """Mamba's mixer calls a ``causal_conv1d_fn`` too, but holds a recurrence's parameters beside its convolution."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("bamba", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=32,
                                  mamba_d_state=16, mamba_n_groups=1, attn_layer_indices=[], vocab_size=256)
    with torch.device("meta"):
        block = AutoModelForCausalLM.from_config(config).model.layers[0]
    assert not any(type(part).__name__ == "TransformersShortConv" for part in mixers.recognize(block).parts)


@pytest.mark.parametrize("bias", [False, True])
def test_titan_ext_forward_equals_transformers(bias):
    """titan_ext's model runs its own forward of the layer (``kernels.transformers_short_conv``, fla's convolution
    contract on the portable kernel); transformers' model its own: equal in fp64, logits and every gradient."""
    from transformers import AutoModelForCausalLM

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = build_model(lfm2(conv_bias=bias))
        model.init_weights()
        assert type(model.model.layers[0].conv).forward.__name__ == "lfm2_forward"
        reference = AutoModelForCausalLM.from_config(model.config)
        missing, unexpected = reference.load_state_dict(model.state_dict(), strict=False)
        assert missing == ["lm_head.weight"] and not unexpected  # tied: the embedding's weight
        assert reference.lm_head.weight is reference.model.embed_tokens.weight
        assert type(reference.model.layers[0].conv).forward.__name__ != "lfm2_forward"
        tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
        ours, theirs = model(tokens), reference(tokens).logits
        ours.sum().backward()
        theirs.sum().backward()
    finally:
        torch.set_default_dtype(torch.float32)
    assert torch.allclose(ours, theirs, rtol=1e-10, atol=1e-10)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad - q.grad).norm() <= 1e-10 * q.grad.norm(), name


def test_documents_restart_the_convolution():
    """With document masking (as a job applies it: per-document attention, ``cu_seq_lens_q``) each packed
    document's logits equal the document's alone: the convolution restarts at every document."""
    torch.manual_seed(0)
    model = build_model(lfm2())
    model.init_weights()
    # a 1-token document, and one shorter than the convolution reaches back
    assert_documents_restart(model, 40, [0, 15, 16, 18], mixed_from=16)


def test_its_flops_count_the_convolution_and_the_gates():
    model = build_model(lfm2())
    conv = model.mixers[0]
    assert conv.flops_per_token(model.config, 0, 40) == 3 * 2 * (4 + 2) * 64
