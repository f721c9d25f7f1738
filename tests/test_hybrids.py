"""Hybrid models: each layer's token mixer (``titan_ext.models.mixers``) decides its TP entries, CP path,
FLOPs and pipeline cost; refusals name the layer, its mixer and the fix. Training under every parallelism
against one process is the integration matrix's (``fla_gla_hybrid``); CP on two real ranks is
``test_context_parallel.py``'s (``_hybrid`` cases)."""

import copy
from types import SimpleNamespace

import pytest
import torch
from helpers import assert_documents_restart, plan_forward

from titan_ext import errors
from titan_ext.errors import ConfigError
from titan_ext.job_plan import CPChoice
from titan_ext.models import mixers
from titan_ext.models.adapter import build_model, meta_model
from titan_ext.models.args import transformers_model
from titan_ext.models.gla import gla_flavors

ATTN = {"layers": [1, 3], "num_heads": 4, "num_kv_heads": 2}


def gla_hybrid(layers=4, attn=ATTN, **fields):
    args = copy.deepcopy(gla_flavors["debugmodel"])
    args.config.update(num_hidden_layers=layers, attn=attn, **fields)
    return args


def test_fla_attn_config_maps_its_layers_to_fla_attention():
    assert [m.name for m in gla_hybrid().layer_mixers()] == ["gla", "fla attention", "gla", "fla attention"]
    assert set(map(type, gla_flavors["debugmodel"].layer_mixers())) == {mixers.GLA}  # a pure model: one mixer
    model = meta_model(gla_hybrid())
    assert [type(block.attn).__name__ for block in model.model.layers] == [
        "GatedLinearAttention", "Attention", "GatedLinearAttention", "Attention"]
    assert model.mixers == gla_hybrid().layer_mixers()


def test_transformers_layer_types_map_each_layer():
    args = transformers_model("qwen3_5_text", num_hidden_layers=4,
                              layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])
    kinds = [type(m) for m in args.layer_mixers()]
    assert kinds == [mixers.TransformersGatedDeltaNet] * 3 + [mixers.TransformersAttention]
    config = args.to_hf_config()  # MFU counts both kinds: the delta rule's per layer, attention's by its heads
    delta = mixers.TransformersGatedDeltaNet().flops_per_token(config, 0, 4096)
    heads, head_dim = config.num_attention_heads, config.head_dim
    assert args.mixer_flops_per_token(4096) == 3 * delta + 12 * heads * head_dim * 4096


def test_flops_count_each_layers_mixer():
    """Attention layers grow with the sequence, GLA layers do not (past fla's 64-token chunk)."""
    hybrid, pure = gla_hybrid(), gla_hybrid(attn=None)
    config = hybrid.to_hf_config()
    gla, attention = mixers.GLA().flops_per_token(config, 0, 2048), 12 * 64 * 2048  # fla: heads x head_dim = width
    assert hybrid.mixer_flops_per_token(2048) == 2 * gla + 2 * attention
    assert pure.mixer_flops_per_token(2048) == 4 * gla == pure.mixer_flops_per_token(4096)
    assert hybrid.mixer_flops_per_token(4096) - hybrid.mixer_flops_per_token(2048) == 2 * attention


def test_tp_plan_is_assembled_per_layer():
    """fla's model types have no registered plan: fla's block names from the structure, and every layer's
    mixer its own entries (a hybrid's GLA and attention layers each their own)."""
    from model_plans import TPOptions, validate_tp

    from titan_ext.models.gated_deltanet import gated_deltanet_flavors
    from titan_ext.parallel.tensor_parallel import tp_plan_class

    gdn = copy.deepcopy(gated_deltanet_flavors["debugmodel"])
    gdn.config.update(num_hidden_layers=4, attn=ATTN)
    model = meta_model(gdn)
    plan_cls = tp_plan_class(model, 2)
    assert layer_entries(plan_cls) == {0: ["gated deltanet"], 1: ["fla attention"], 2: ["gated deltanet"],
                                       3: ["fla attention"]}, layer_entries(plan_cls)
    assert "attn.a_proj" in plan_cls(TPOptions()).block_plan(0) and "attn.a_proj" not in plan_cls(TPOptions()).block_plan(1)
    validate_tp(model, plan_cls(TPOptions()), 2, 80)

    model = meta_model(gla_hybrid())
    plan_cls = tp_plan_class(model, 2)
    assert plan_cls.__name__ == "FlaTPPlan" and layer_entries(plan_cls)[1] == ["fla attention"]
    plan = plan_cls(TPOptions())
    assert "attn.gk_proj.1" in plan.block_plan(0) and "attn.gk_proj.1" not in plan.block_plan(1)
    assert "attn.q_norm" in plan.block_plan(3)
    validate_tp(model, plan, 2, 80)  # every parameter of both mixers covered, every split even


def test_transformers_hybrid_tp_plan_translates_its_attention_and_takes_the_gated_deltanet_entries():
    """Qwen3.5: its own HF plan (translated) for the attention layers and MLPs; its Gated DeltaNet layers (whose HF
    entries, ``colwise_gather_output``, do not translate) take the mixer's own entries;
    whole heads per rank."""
    from model_plans import TPOptions, validate_tp

    from titan_ext.parallel.tensor_parallel import tp_plan_class

    model = meta_model(transformers_model("qwen3_5_text", **QWEN3_5))
    plan_cls = tp_plan_class(model, 2)
    assert layer_entries(plan_cls) == {0: ["transformers' gated deltanet"]}
    plan = plan_cls(TPOptions())
    assert "linear_attn.in_proj_qkv" in plan.block_plan(0) and "self_attn.q_proj" in plan.block_plan(1)
    assert not any(name.startswith("linear_attn") for name in plan.block_plan(1))
    validate_tp(model, plan, 2, 80)
    # Qwen3-Next: its shared expert a dense FFN inside the MoE block (partial shares, the gate replicated), its
    # routed experts placed by EP (matrix hf_qwen3_next/ep2_tp2) or split over TP (hf_qwen3_next/docs_tp2)
    next_model = meta_model(transformers_model("qwen3_next", **QWEN3_NEXT))
    next_plan = tp_plan_class(next_model, 2)(TPOptions(expert_parallel=True))
    moe = {name: repr(style).partition("(")[0] for name, style in next_plan.block_plan(1).items() if name.startswith("mlp")}
    assert moe == {"mlp": "MoEBlockParallel", "mlp.gate": "NormParallel", "mlp.experts": "PlacedElsewhere",
                   "mlp.shared_expert.gate_proj": "ColwiseParallel", "mlp.shared_expert.up_proj": "ColwiseParallel",
                   "mlp.shared_expert.down_proj": "Composed", "mlp.shared_expert_gate": "ScalesShares"}, moe
    validate_tp(next_model, next_plan, 2, 80)
    validate_tp(next_model, tp_plan_class(next_model, 2)(TPOptions()), 2, 80)
    odd = meta_model(transformers_model("qwen3_5_text", **{**QWEN3_5, "linear_num_key_heads": 1}))
    with pytest.raises(ValueError, match="linear_num_key_heads=1 is not divisible by --parallelism.tensor_parallel_degree=2"):
        validate_tp(odd, tp_plan_class(odd, 2)(TPOptions()), 2, 80)


def test_a_layer_without_a_path_is_refused_naming_it(monkeypatch):
    """One line naming the layer, its mixer and the fix, before the build."""
    from titan_ext.parallel.context_parallel import check_cp
    from titan_ext.parallel.tensor_parallel import tp_plan_class

    fused = gla_hybrid(attn_mode="fused_chunk")
    assert fused.context_parallel_blocker() == (
        "layer 0 (gla): GLA's attn_mode 'fused_chunk' has no context-parallel path; use attn_mode 'chunk' "
        "(fla's default)")
    assert fused.document_mask_blocker().startswith("layer 0 (gla): GLA's attn_mode 'fused_chunk' takes no cu_seqlens")
    job = SimpleNamespace(parallelism=SimpleNamespace(context_parallel_degree=2))
    with pytest.raises(ConfigError, match=r"context_parallel_degree=2: layer 0 \(gla\)"):
        check_cp(fused, job)
    assert gla_hybrid(attn={"layers": [1], "num_heads": 4, "window_size": 8}).ring_attention_blocker() == "window_size=8"

    qwen = transformers_model("qwen3_5_text", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                              linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"])
    assert qwen.document_mask_blocker() is None and qwen.context_parallel_blocker() is None  # both paths now
    monkeypatch.setattr(mixers.TransformersGatedDeltaNet, "tp_entries", lambda self, plan: None)  # none
    with pytest.raises(ConfigError, match=r"layer 0's token mixer 'linear_attn' \(transformers' gated deltanet\) has "
                                          "no tensor-parallel plan in titan_ext; set the degree to 1"):
        tp_plan_class(meta_model(qwen), 2)


def layer_entries(plan_cls) -> dict[int, list[str]]:
    """The layers whose token mixers bring their own TP entries, and those mixers."""
    return {index: [part.name for part in entries.parts] for index, entries in plan_cls.layer_mixers}


def test_pipeline_stages_balance_each_layers_cost():
    """Long sequences make the attention layers (4, 5) the costly ones: the first stage takes layers 0-4,
    where splitting by index would give each stage three."""
    from titan_ext.parallel.pipeline_plan import layer_costs, pp_choice

    with torch.device("meta"):
        model = build_model(gla_hybrid(layers=6, attn={"layers": [4, 5], "num_heads": 4}))
    p = SimpleNamespace(
        pipeline_parallel_degree=2, pipeline_parallel_schedule="1F1B", pipeline_parallel_microbatch_size=1,
        pipeline_parallel_layers_per_stage=None, pipeline_parallel_first_stage_less_layers=1,
        pipeline_parallel_last_stage_less_layers=1, module_fqns_per_model_part=None,
        data_parallel_shard_degree=1, data_parallel_replicate_degree=1, tensor_parallel_degree=1,
        context_parallel_degree=1, expert_parallel_degree=1, pipeline_parallel_expert_parallel_overlap=False,
    )
    job = SimpleNamespace(parallelism=p, validation=SimpleNamespace(enable=False),
                          training=SimpleNamespace(local_batch_size=4, global_batch_size=-1, seq_len=8192))
    costs = layer_costs(model, 8192)
    assert costs[0] == costs[3] < costs[4] == costs[5]
    stages = pp_choice(model, job, world_size=2).stages
    assert stages == (("model.embeddings", *(f"model.layers.{i}" for i in range(5))),
                      ("model.layers.5", "model.norm", "lm_head"))
    job.training.seq_len = 64  # short sequences: every layer costs about the same, three per stage
    assert pp_choice(model, job, world_size=2).stages[1][0] == "model.layers.3"



@pytest.mark.parametrize("unbound", [None, 0, 1])
def test_the_first_step_checks_each_layers_cp_path_ran(cp_mesh, unbound):
    """Both paths on one mesh; a layer whose binding is undone (its mixer back to the class it had before
    CP) stops the job after step 1, naming the path that ran too few times."""
    from titan_ext.parallel.context_parallel import apply_cp

    torch.manual_seed(0)
    model = build_model(gla_hybrid(layers=2, attn={"layers": [1], "num_heads": 4, "num_kv_heads": 2}))
    model.init_weights()
    before = [type(block.attn) for block in model.model.layers]
    choice = CPChoice(2, 1, masked_attention="a test's mask")
    apply_cp(model, cp_mesh, choice, plan_forward(model, cp=choice, cp_mesh=cp_mesh).cp_layout)
    assert all(type(block.attn) is not cls for block, cls in zip(model.model.layers, before))
    assert model.forward_plan.cp_layout.expected == {"state passing": 1, "fla attention": 1}
    if unbound is not None:
        model.model.layers[unbound].attn.__class__ = before[unbound]
    tokens = torch.randint(0, 2048, (2, 80))
    errors.take_deferred()
    model(tokens, positions=torch.arange(80, 160).expand(2, 80))
    deferred = errors.take_deferred()
    if unbound is None:
        assert deferred is None
    else:
        path = ["state passing", "fla attention"][unbound]
        assert f"a layer's path did not run in step 1's forward ({path}: 0 of 1 layers)" in str(deferred)
    model(tokens, positions=torch.arange(80, 160).expand(2, 80))  # checked once
    assert errors.take_deferred() is None


def test_the_first_step_checks_transformers_gated_deltanet_cp_path_ran(cp_mesh):
    """Qwen3.5's Gated DeltaNet layer counts its state passing; its binding undone, step 1 stops naming it."""
    from titan_ext.parallel.context_parallel import apply_cp

    torch.manual_seed(0)
    model = build_model(transformers_model("qwen3_5_text", **QWEN3_5))
    model.init_weights()
    before = type(model.model.layers[0].linear_attn)
    choice = CPChoice(2, 1, masked_attention="a test's mask")
    apply_cp(model, cp_mesh, choice, plan_forward(model, cp=choice, cp_mesh=cp_mesh).cp_layout)
    assert model.forward_plan.cp_layout.expected == {"state passing": 1, "transformers attention": 1}
    model.model.layers[0].linear_attn.__class__ = before
    errors.take_deferred()
    model(torch.randint(0, 256, (2, 80)), positions=torch.arange(80, 160).expand(2, 80))
    assert "(state passing: 0 of 1 layers)" in str(errors.take_deferred())


QWEN3_5 = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=16, linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"])


QWEN3_NEXT = {**QWEN3_5, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "shared_expert_intermediate_size": 32}


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_transformers_gated_deltanet_runs_titan_ext_forward_equal_to_transformers(model_type):
    """titan_ext's model runs its own forward of the layer (``kernels.transformers_gated_deltanet``, fla's kernel
    contracts); transformers' model runs its own, here on titan_ext's portable kernel (on the CPU transformers
    would call fla's Triton one): equal in fp64, logits and every gradient. transformers' torch fallback kernel
    computes in fp32 inside: the logits agree with it to fp32's precision. (transformers computes the decay in
    fp32 even in an fp64 model, titan_ext's forward at the model's precision: they agree to ~1e-7.)"""
    import importlib

    from transformers import AutoModelForCausalLM

    from titan_ext.kernels import binding, gated_delta

    short = model_type.removesuffix("_text")
    modeling = importlib.import_module(f"transformers.models.{short}.modeling_{short}")
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        dense = {**QWEN3_NEXT, "mlp_only_layers": [0, 1]}  # Qwen3-Next's layers, dense FFNs: its experts are slow in fp64
        model = build_model(transformers_model(model_type, **(QWEN3_5 if short == "qwen3_5" else dense)))
        model.init_weights()
        assert type(model.model.layers[0].linear_attn).forward.__name__ == f"{short}_forward"
        theirs = []
        wrapper = modeling.torch_chunk_gated_delta_rule  # transformers' hub wrapper: fla's kernel, keywords filtered
        for key, kernel in (("portable", binding.hub_wrapper(wrapper, gated_delta.chunk_gated_delta_rule)),
                            ("fallback", wrapper.__wrapped__)):
            reference = AutoModelForCausalLM.from_config(model.config)
            reference.load_state_dict(model.state_dict())
            used = binding.bind(reference, {}, key=f"test:{key}", names={modeling.__name__: {
                "torch_chunk_gated_delta_rule": kernel}})
            assert (modeling.__name__, "torch_chunk_gated_delta_rule") in used
            theirs.append(reference)
        tokens = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(1))
        ours, (same, fallback) = model(tokens), [reference(tokens).logits for reference in theirs]
        ours.sum().backward()
        same.sum().backward()
    finally:
        torch.set_default_dtype(torch.float32)
        binding.forget("test:")
    assert torch.allclose(ours, same, rtol=1e-6, atol=1e-6) and torch.allclose(ours, fallback, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), theirs[0].parameters()):
        assert (p.grad - q.grad).norm() <= 5e-6 * q.grad.norm(), name  # the decay's gradients: ~8e-7


def test_a_portable_transformers_hybrid_keeps_transformers_forward_and_generates():
    """``kernels.portable`` (a model run as its library runs it, not trained by titan_ext) keeps transformers'
    forward of the layer, on titan_ext's portable kernels: it generates with a cache on the CPU."""
    from transformers import AutoModelForCausalLM

    from titan_ext import kernels

    torch.manual_seed(0)
    model = kernels.portable(AutoModelForCausalLM.from_config(transformers_model("qwen3_5_text", **QWEN3_5).to_hf_config()))
    assert type(model.model.layers[0].linear_attn).forward.__name__ == "forward"
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)


def test_documents_restart_transformers_gated_deltanet_state_and_convolution():
    """With document masking (as a job applies it: per-document attention, ``cu_seq_lens_q``) each packed
    document's logits equal the document's alone: the delta rule's state and its short convolution restart."""
    torch.manual_seed(0)
    model = build_model(transformers_model("qwen3_5_text", **QWEN3_5))
    model.init_weights()
    # a 1-token document, and one shorter than the convolution reaches back
    assert_documents_restart(model, 80, [0, 30, 31, 65], mixed_from=31)


def test_a_pipeline_stage_lists_its_own_blocks_layer_types():
    """transformers' hybrid decoders pick each block's mask by ``config.layer_types[i]``, ``i`` counted from the
    stage's first block: a stage's config lists its own blocks' kinds; the whole model's is unchanged."""
    from titan_ext.parallel.pipeline import stage_model

    types = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    with torch.device("meta"):
        model = build_model(transformers_model("qwen3_5_text", **{**QWEN3_5, "num_hidden_layers": 4, "layer_types": types}))
    stage = stage_model(model, ("model.layers.1", "model.layers.2", "model.norm", "lm_head"))
    assert stage.model.config.layer_types == ["full_attention", "linear_attention"]
    assert model.config.layer_types == types and list(map(type, stage.mixers)) == list(map(type, model.mixers))


def test_the_planner_plans_the_documented_hybrid_layout(capsys):
    """docs/hybrids.md's planner command: a GLA hybrid under FSDP x CP x TP on 8 planned ranks."""
    from pathlib import Path

    from titan_ext.plan import main

    toml = Path(__file__).resolve().parents[1] / "train_configs" / "debug_gla_hybrid.toml"
    assert main(["--job.config_file", str(toml), "--world", "8",
                 "--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"]) == 0
    out = capsys.readouterr().out
    assert "fla_gla debugmodel_hybrid on 8 ranks: fsdp 2 x cp 2 x tp 2" in out
    kinds = {tuple(line.split()[:2]) for line in out.splitlines()}
    assert {("all_gather", "cp"), ("reduce_scatter", "tp"), ("all_gather", "fsdp")} <= kinds
