"""Multi-head latent attention and transformers' Kimi Linear: layer map, portable KDA, documents, refusals.

Their parallelisms run end to end in the integration matrix (``hf_deepseek_v3``: TP2;
``hf_kimi_linear``: FSDP2, EP2, EP2 x TP2 x FSDP2, PP2, HF export/import; ``hf_kimi_linear_dense``: TP2, CP2 with and
without documents)."""

from __future__ import annotations

import torch

from titan_ext.models import mixers
from titan_ext.models.adapter import build_model, meta_model
from titan_ext.models.args import transformers_model

KIMI = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, linear_num_heads=2,
            linear_head_dim=8, layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "dense"],
            vocab_size=128, max_position_embeddings=256, pad_token_id=None, bos_token_id=None, eos_token_id=None)


def kimi(**fields):
    return transformers_model("kimi_linear", **{**KIMI, **fields})


def test_kimi_linear_maps_kda_and_mla_layers_and_counts_both():
    args = kimi()
    kda, mla = args.layer_mixers()
    assert isinstance(kda, mixers.TransformersKDA) and isinstance(mla, mixers.TransformersMLA)
    config = args.to_hf_config()
    # MLA: 6 x heads x (qk + v head dims) x keys; KDA: the chunked delta rule
    assert mla.flops_per_token(config, 1, 64) == 6 * 2 * (12 + 6) * 64
    assert args.mixer_flops_per_token(64) == kda.flops_per_token(config, 0, 64) + 6 * 2 * 18 * 64


def _fp64_model(args):
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    return model


def test_kimi_linear_kda_takes_the_portable_kernel_equal_to_transformers_reference():
    """On the CPU transformers would call fla's Triton kernel (fla is installed); titan_ext's model calls its
    portable one, equal to transformers' own model with its torch reference and convolution (its modeling
    file's fallbacks, ``__wrapped__`` by the hub-kernel wrappers)."""
    from transformers.models.kimi_linear import modeling_kimi_linear as modeling

    from titan_ext.kernels import binding

    torch.set_default_dtype(torch.float64)
    try:
        model = _fp64_model(kimi())
        reference = modeling.KimiLinearForCausalLM(model.config)
        reference.load_state_dict(model.state_dict(), strict=False)  # the state dict omits no weight: checked below
        names = {name: getattr(modeling, name).__wrapped__ for name in ("chunk_kimi_delta_attention", "causal_conv1d_fn")}
        used = binding.bind(reference, {}, key="test:reference", names={modeling.__name__: names})
        assert {(modeling.__name__, name) for name in names} <= used
        tokens = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
        ours, theirs = model(tokens), reference(tokens).logits
        ours.sum().backward()
        theirs.sum().backward()
    finally:
        torch.set_default_dtype(torch.float32)
        binding.forget("test:reference")
    assert type(model.model.layers[0].self_attn) is not type(reference.model.layers[0].self_attn)  # two bindings
    # transformers' reference computes the recurrence in float32 whatever its inputs: agreement to float32's
    assert relative(ours, theirs) < 1e-6
    theirs_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert relative(p.grad, theirs_params[name].grad) < 1e-5, name


def relative(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_kimi_linear_documents_each_run_alone():
    """Packed documents (``--titan_ext.document_mask``): the KDA layer's state and convolution and the MLA
    layer's attention restart at every document; each document's logits equal its own forward alone."""
    from helpers import plan_forward

    from titan_ext.data.documents import apply_document_attention

    torch.set_default_dtype(torch.float64)
    try:
        model = _fp64_model(kimi())
        apply_document_attention(model)
        plan_forward(model, document_mask=True)
        tokens = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(2))
        starts = [(0, 19), (0, 30, 41)]  # each row's document starts
        positions = torch.stack([torch.cat([torch.arange(e - s) for s, e in zip(row, (*row[1:], 48))]) for row in starts])
        packed = model(tokens, document_positions=positions)
        for b, row in enumerate(starts):
            for s, e in zip(row, (*row[1:], 48)):
                alone = model(tokens[b:b + 1, s:e])
                assert torch.allclose(packed[b, s:e], alone[0], rtol=1e-9, atol=1e-10), (b, s, e)
    finally:
        torch.set_default_dtype(torch.float32)


def test_moe_ffns_of_kimi_and_deepseek_split_under_tp_with_or_without_ep():
    """Kimi Linear's and DeepSeek-V3's MoE FFNs under TP: every parameter covered (router, shared experts, the experts
    placed by titan_ext.parallel.expert_parallel: split over TP, or by EP); the runs: ``hf_kimi_linear/tp2``,
    ``ep2_tp2_fsdp2``, ``hf_deepseek_v3/tp2``."""
    from model_plans import TPOptions, validate_tp

    from titan_ext.parallel.tensor_parallel import tp_plan_class

    def check(args, expert_parallel=False):
        model = meta_model(args)
        validate_tp(model, tp_plan_class(model, 2)(TPOptions(expert_parallel=expert_parallel)), 2)

    moe = kimi(mlp_layer_types=["dense", "sparse"], num_experts=4, num_experts_per_token=2, moe_intermediate_size=16)
    deepseek = transformers_model("deepseek_v3", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16,
                                  kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6,
                                  n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                  first_k_dense_replace=1, vocab_size=128)
    for expert_parallel in (False, True):
        check(moe, expert_parallel)
        check(deepseek, expert_parallel)
    check(kimi())  # dense: MLA and KDA layers split


def test_kimi_mlp_entry_lays_out_moe_blocks_and_dense_mlps_each_their_way():
    """One ``mlp`` entry for both kinds of layer: a MoE block (``experts``) takes ``moe_block`` (input gathered, output
    summed from the ranks' shares), a dense MLP only the gather; experts placed by titan_ext.parallel.expert_parallel
    (split over TP, or by EP)."""
    import torch.nn as nn
    from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput

    from model_plans import TPOptions
    from model_plans.kimi_linear import DenseOrMoE, KimiLinearTPPlan
    from model_plans.styles import MoEBlockParallel

    applied = []

    class Record(ParallelStyle):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def _apply(self, module, device_mesh):
            applied.append(self.name)
            return module

    block = nn.Module()
    block.experts = nn.Module()
    DenseOrMoE(Record("dense"), Record("moe"))._apply(block, None)
    DenseOrMoE(Record("dense"), Record("moe"))._apply(nn.Module(), None)
    assert applied == ["moe", "dense"]
    plan = KimiLinearTPPlan(TPOptions(expert_parallel=True)).mlp_plan()
    assert isinstance(plan["mlp"].moe, MoEBlockParallel) and isinstance(plan["mlp"].dense, PrepareModuleInput)
    by = {ep: KimiLinearTPPlan(TPOptions(expert_parallel=ep)).mlp_plan()["mlp.experts"].style.by for ep in (False, True)}
    assert by == {False: "each expert's intermediate dim over TP", True: "expert parallelism"}


def test_kimi_linear_cp_pieces_shorter_than_its_convolution_are_refused(tmp_path, monkeypatch):
    """Each CP piece must hold the 3 earlier inputs its layers' 4-tap q/k/v convolution reads."""
    import json
    from pathlib import Path

    from helpers import first_error

    config = tmp_path / "kimi.json"
    config.write_text(json.dumps({"model_type": "kimi_linear", **KIMI, "vocab_size": 2048}))  # the tokenizer's
    monkeypatch.setenv("WORLD_SIZE", "2")
    toml = Path(__file__).resolve().parents[1] / "train_configs" / "debug_llama.toml"
    message = first_error(["--job.config_file", str(toml), "--model.name", "hf", "--titan_ext.hf_config", str(config),
                           "--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                           "--training.seq_len", "8"], 2)
    assert message == ("--training.seq_len=8 makes context-parallel pieces of 2 tokens, shorter than the 3 earlier "
                       "inputs each short convolution reads; use at least 12 tokens")
