"""transformers' Mamba2 mixers (``models.mixers.mamba2``): recognised by what they hold and call in every family
that copies ``Mamba2Mixer``, trained through titan_ext's forward (``kernels.transformers_mamba2``) equal to
transformers' own; documents restart the scan and the convolution; TP's shares and refusals; fla's own Mamba2
layer through the same math, equal to fla's. TP and CP on two real ranks against one process are the integration
matrix's (``hf_nemotron_h``, ``fla_mamba2``: ``tp2``, ``cp2``, ``cp2_docs``);
the scan's state passing is ``test_state_passing.py``'s (``simple_gla``)."""

import pytest
import torch
from helpers import assert_documents_restart

from titan_ext.census.configs import tiny_config
from titan_ext.models import mixers
from titan_ext.models.adapter import build_model
from titan_ext.models.args import transformers_model

SEQ = 40

FAMILIES = {  # two layers each (Bamba and Granite: the first Mamba2, the second attention)
    "mamba2": {"num_hidden_layers": 2},
    "bamba": {"num_hidden_layers": 2, "attn_layer_indices": [1]},
    "granitemoehybrid": {"num_hidden_layers": 2, "layer_types": ["mamba", "attention"]},
    "nemotron_h": {"num_hidden_layers": 2, "layers_block_type": ["linear_attention", "full_attention"],
                   "n_groups": 2, "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16},
    "zamba2": {"num_hidden_layers": 2, "layers_block_type": ["linear_attention", "linear_attention"]},
}


def tiny(model_type: str, **fields):
    config = {**tiny_config(model_type), **FAMILIES.get(model_type, {}), **fields}
    config.pop("model_type", None)
    return transformers_model(model_type, **config)


def titan_and_transformers(model_type: str):
    """titan_ext's training model and transformers' own from the same weights."""
    import fla  # noqa: F401  (titan_ext's models take their training forwards where fla is imported)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = build_model(tiny(model_type))
    model.init_weights()
    reference = AutoModelForCausalLM.from_config(model.config)
    reference.load_state_dict(model.state_dict(), strict=False)  # Zamba2 ties its head: no key of its own
    reference.tie_weights()
    return model, reference


def assert_trains_equal(model, reference):
    """Logits within 1e-5 and every gradient within 1e-5 of ``reference``'s in fp32; the decay's parameters
    (``A_log``, ``dt_bias``) within 2e-3 (see ``test_mamba2_mixers_train_equal_to_transformers``)."""
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    ours, theirs = model(tokens), reference(tokens, use_cache=False).logits
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    ours.sum().backward()
    theirs.sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        decay = name.endswith(("A_log", "dt_bias"))
        assert (p.grad - q.grad).norm() <= (2e-3 if decay else 1e-5) * q.grad.norm() + 1e-9, name


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_mamba2_mixers_train_equal_to_transformers(model_type):
    """Logits and every gradient equal transformers' forward (its torch reference kernels) in fp32. The decay's
    parameters (``A_log``, ``dt_bias``) take a gradient summed over every pair of tokens, with cancellation: the
    portable simple GLA's fp32 cumulative decays leave it ~1e-4 off (both are as far from fp64, measured on Bamba:
    transformers 2e-5, titan_ext 6e-4 on the smallest); 1e-5 everywhere else."""
    model, reference = titan_and_transformers(model_type)
    assert any(isinstance(mixer, mixers.TransformersMamba2) for mixer in model.mixers)
    found = next(m for m in model.modules() if type(m).__name__.endswith(("Mixer", "MambaLayer")))
    assert type(found).forward.__name__ == "mamba2_forward"
    assert_trains_equal(model, reference)


def test_documents_restart_mamba2_scan_and_convolution():
    """With document masking (as a job applies it: ``cu_seq_lens_q``) each packed document's logits equal the
    document's alone: the scan's state and the short convolution restart."""
    model, _ = titan_and_transformers("mamba2")
    # a 1-token document, and one shorter than the convolution reaches back
    assert_documents_restart(model, SEQ, [0, 15, 16, 33], mixed_from=16)


def test_falcon_h1_mamba_is_left_unknown():
    """Falcon-H1's mixer holds Mamba2's parts but scales its input and projections (μP multipliers, a buffer) and
    may gate after its norm: titan_ext's forward would be wrong, so it stays an unknown mixer (replicated under TP,
    CP and documents refused in one line)."""
    args = tiny("falcon_h1", num_hidden_layers=1)
    parts = [part for mixer in args.layer_mixers() for part in mixer.parts]
    assert [type(part) for part in parts] == [mixers.TransformersAttention, mixers.Unknown]
    assert ("FalconH1Mixer) is not one titan_ext knows (it calls Mamba2's kernels but holds buffers mup_vector; has "
            "no MambaRMSNormGated norm: not the Mamba2 math titan_ext computes)") in args.context_parallel_blocker()


def share(heads, groups, ranks, rank):
    """The share of ``rank`` of a mixer of ``heads`` heads of 4 channels in ``groups`` groups of 2 states."""
    from types import SimpleNamespace

    from titan_ext.kernels.transformers_mamba2 import Share

    return Share.on(SimpleNamespace(num_heads=heads, n_groups=groups, head_dim=4, ssm_state_size=2), ranks, rank)


@pytest.mark.parametrize("heads,groups,ranks,rank,rows,whole", [
    # no TP: z, x, B, C, dt whole
    (4, 2, 1, 0, [(0, 16), (16, 16), (32, 4), (36, 4), (40, 4)], True),
    # two groups over two ranks: rank 1 has heads 2-3 and group 1
    (4, 2, 2, 1, [(8, 8), (24, 8), (34, 2), (38, 2), (42, 2)], True),
    # one group over two ranks: both take all of B and C; the group's norm spans the ranks
    (4, 1, 2, 1, [(8, 8), (24, 8), (32, 2), (34, 2), (38, 2)], False),
])
def test_each_rank_multiplies_its_heads_and_groups_rows(heads, groups, ranks, rank, rows, whole):
    found = share(heads, groups, ranks, rank)
    assert found.projection_rows() == rows and found.whole_groups is whole


def test_tp_refuses_heads_or_groups_that_do_not_split():
    module = build_model(tiny("mamba2", num_heads=6, n_groups=3, head_dim=32, expand=3)).backbone.layers[0].mixer
    mixer = mixers.TransformersMamba2("mixer", module)
    assert mixer.tensor_parallel_blocker(3) is None and mixer.tensor_parallel_blocker(6) is None
    assert "6 heads in 3 groups do not split over 2 ranks" in mixer.tensor_parallel_blocker(2)
    assert "do not split over 4 ranks" in mixer.tensor_parallel_blocker(4)


FLA_MAMBA2 = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 8, "head_dim": 16,
              "state_size": 16, "chunk_size": 16, "dt_min": 0.1, "dt_max": 1.0}
"""Steps ``dt`` up to 1 (fla's default 0.1 at most): the scan, not the skip, then makes the logits."""


def titan_and_fla(**fields):
    """titan_ext's training model of fla's Mamba2 and fla's own (its torch forward; its norms on the portable
    kernels, Triton having no CPU) from the same weights."""
    from fla.models import Mamba2ForCausalLM

    from titan_ext import kernels

    torch.manual_seed(0)
    model = build_model(fla_model_args(**fields))
    model.init_weights()
    reference = kernels.bind(Mamba2ForCausalLM(model.config), "portable")
    reference.load_state_dict(model.state_dict())
    return model, reference


@pytest.mark.parametrize("fields", [
    {},
    {"norm_before_gate": True},  # fla's norm before its gate
    {"D_has_hdim": True, "dt_limit": [0.0, 0.05]},  # a skip per channel; dt clamped
])
def test_fla_mamba2_trains_equal_to_fla(fields):
    """fla's Mamba2 layer, known by its class, trains through titan_ext's forward (``kernels.fla_mamba2``): logits
    and every gradient equal fla's own forward in fp32 (the decay's parameters within the portable scan's fp32
    cumulative decays, as for transformers' above). One group: with more, fla's torch fallback gives head ``h``
    group ``h % G`` (it tiles B and C), while mamba_ssm's kernel (fla's CUDA path), transformers and titan_ext give
    it group ``h // (H / G)``."""
    model, reference = titan_and_fla(**fields)
    assert all(isinstance(mixer, mixers.FlaMamba2) for mixer in model.mixers)
    assert type(model.backbone.layers[0].mixer).forward.__name__ == "fla_mamba2_forward"
    assert_trains_equal(model, reference)


def test_fla_mamba2_documents_restart():
    """fla's blocks hand their mixer the packed documents' ``cu_seqlens``: scan and convolution restart."""
    model, _ = titan_and_fla()
    assert_documents_restart(model, SEQ, [0, 15, 16, 33], mixed_from=16)


def test_fla_mamba2_without_its_norm_is_unknown():
    """``rmsnorm=False`` leaves the layer without a gated norm (``y * act(z)``): not this forward's math, so an
    unknown mixer (it trains; CP and documents refused in one line)."""
    args = fla_model_args(rmsnorm=False)
    assert [type(part) for mixer in args.layer_mixers() for part in mixer.parts] == [mixers.Unknown] * 2
    assert "(fla.layers.mamba2.Mamba2) is not one titan_ext knows" in args.context_parallel_blocker()


def fla_model_args(**fields):
    from titan_ext.models.args import fla_model

    return fla_model("mamba2", **{**FLA_MAMBA2, **fields})
