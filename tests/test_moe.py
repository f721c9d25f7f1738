"""Mixture-of-experts models (titan_ext.models.moe, titan_ext.parallel.moe_plan and expert_parallel): the routers'
balancing loss as the model computes it, counted per token so that splitting a batch (over ranks or micro-batches)
changes nothing; MFU counting active experts; expert parallelism (with TP: the TP ranks share the tokens) and what it
refuses in one line."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from titan_ext.host.moe_metrics import step_metrics
from titan_ext.models.moe.balance_loss import balance_loss_sum, with_balance_loss
from titan_ext.models.moe.bias_router import BIAS_RATE, apply_expert_bias, update_expert_bias
from titan_ext.models.moe.blocks import moe_blocks, router_of
from titan_ext.models.moe.records import (
    RECORDS, _pack, _receive_statistics, _stage_end, _statistics_width, _unpack, apply_router_records, routed_statistics,
)
from titan_ext.errors import ConfigError
from titan_ext.models.adapter import build_model, meta_model
from titan_ext.models.args import HFModelArgs, idle_expert_params
from titan_ext.models.forward_plan import ForwardPlan
from titan_ext.parallel.expert_parallel import _local_experts, apply_ep, apply_expert_tp
from titan_ext.parallel.moe_plan import check_moe, moe_choice

REPO = Path(__file__).resolve().parents[1]
TINY = json.loads((REPO / "train_configs" / "debug_qwen3_moe.json").read_text())
TINY_OLMOE = {"model_type": "olmoe", "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
              "vocab_size": 2048, "router_aux_loss_coef": 0.01, "max_position_embeddings": 512}
TINY_GPT_OSS = {"model_type": "gpt_oss", "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8,
                "num_experts_per_tok": 2, "vocab_size": 2048, "router_aux_loss_coef": 0.01,
                "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
                "max_position_embeddings": 512}
"""gpt-oss: its MoE block holds ``router`` (with a bias) and experts with biases and a clamped SwiGLU."""


def args(base=TINY, **overrides) -> HFModelArgs:
    a = HFModelArgs(library="transformers")
    a.update_from_hf_config({**copy.deepcopy(base), **overrides}, "test")
    return a


def real_model(seed: int = 0, base=TINY, **overrides):
    a = args(base, **overrides)
    torch.manual_seed(seed)
    model = a.hf_model_class(a.to_hf_config())
    return model.float().eval()


def cross_entropy_sum(pred, labels):
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")


def titan_loss(model, tokens, labels):
    """What torchtitan's step computes: the built loss (a sum) on the model's logits."""
    apply_router_records(model, moe_choice(model))
    loss_fn = with_balance_loss(lambda job_config: cross_entropy_sum)(None)
    return loss_fn(model(tokens).logits, labels)


@pytest.mark.parametrize("base", [TINY, TINY_OLMOE, TINY_GPT_OSS], ids=["qwen3_moe", "olmoe", "gpt_oss"])
def test_balance_loss_is_the_models_own_for_one_sequence(base):
    """One sequence: titan_ext's loss / tokens == transformers' CE + router_aux_loss_coef x its aux_loss."""
    model = real_model(base=base)
    tokens = torch.randint(0, 2048, (1, 24))
    labels = torch.randint(0, 2048, (1, 24))
    ours = titan_loss(model, tokens, labels) / labels.numel()
    out = model(tokens, output_router_logits=True)
    aux = out.aux_loss  # the model's own (transformers adds router_aux_loss_coef x this to its loss)
    theirs = cross_entropy_sum(out.logits, labels) / labels.numel() + 0.01 * aux
    assert aux > 1.5  # a real term: top_k = 2 when perfectly balanced
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


def _packed_step_loss(**overrides) -> torch.Tensor:
    """titan_ext's model and loss on two packed documents (the block-causal 4D mask path), from seed 0."""
    a = args(**overrides)
    torch.manual_seed(0)
    model = build_model(a).float()
    apply_router_records(model, moe_choice(model))
    tokens = torch.randint(0, 2048, (2, 24))
    document_positions = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, -1)
    loss_fn = with_balance_loss(lambda job_config: cross_entropy_sum)(None)
    return loss_fn(model(tokens, document_positions=document_positions), torch.roll(tokens, -1, 1))


def test_a_config_asking_for_router_logits_trains_with_the_balancing_loss_counted_once():
    """``output_router_logits: true``: transformers' causal LM would add its own balancing loss (from a mask it
    cannot read, a packed 4D one); titan_ext counts it, once, as for ``false``."""
    from titan_ext.host import checks

    asked = args(output_router_logits=True)
    assert asked.to_hf_config().output_router_logits is False and asked.architecture()["output_router_logits"]
    checks.check_transformers_attention(asked)  # the preflight's probe on a 4D mask
    counted = _packed_step_loss(output_router_logits=False)
    assert _packed_step_loss(output_router_logits=True) == counted
    assert counted - _packed_step_loss(router_aux_loss_coef=0.0) > 0.01 * 1.5 * 48  # the term, once


def test_balance_loss_per_sequence_with_ignored_labels():
    """Each sequence: its valid tokens x the model's loss with those tokens as its mask."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    torch.manual_seed(1)
    logits = [torch.randn(3 * 10, 8) for _ in range(2)]
    labels = torch.randint(0, 5, (3, 10))
    labels[1, :4] = -100
    ours, counts = balance_loss_sum(logits, labels, 8, 2)
    expected = 0.0
    for b in range(3):
        mask = (labels[b : b + 1] != -100).long()
        rows = tuple(x.view(3, 10, 8)[b] for x in logits)
        expected += mask.sum() * load_balancing_loss_func(rows, 8, 2, attention_mask=mask)
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)
    assert counts.shape == (2, 8) and counts.sum() == 2 * 30 * 2


def test_gradients_equal_for_one_batch_and_its_micro_batches():
    """Two sequences at once, or one per micro-batch (accumulated, or on two data-parallel ranks): the same
    gradients, because a sequence's term needs nothing from the others."""
    tokens = torch.randint(0, 2048, (2, 16))
    labels = torch.randint(0, 2048, (2, 16))
    whole, split = real_model(), real_model()
    (titan_loss(whole, tokens, labels) / labels.numel()).backward()
    for b in range(2):
        (titan_loss(split, tokens[b : b + 1], labels[b : b + 1]) / labels.numel()).backward()
    for (name, a), b in zip(whole.named_parameters(), split.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
    gate = whole.model.layers[0].mlp.gate.weight.grad
    assert gate is not None and gate.abs().sum() > 0


def test_recompute_in_backward_records_nothing():
    """Activation checkpointing routes a block again during backward: that must not reach the next loss."""
    from torch.utils.checkpoint import checkpoint

    model = real_model()
    apply_router_records(model, moe_choice(model))
    block = model.model.layers[0].mlp
    forward = block.forward
    block.forward = lambda x: checkpoint(forward, x, use_reentrant=False)
    tokens = torch.randint(0, 2048, (1, 8))
    model(tokens).logits.sum().backward()  # layer 0's block routes again in here
    RECORDS.take()
    model(tokens)
    assert len(RECORDS.take()[0]) == 2  # the next forward's loss sees its 2 MoE layers only


def test_a_forward_without_its_loss_is_an_error():
    model = real_model()
    apply_router_records(model, moe_choice(model))
    tokens = torch.randint(0, 2048, (1, 8))
    model(tokens)
    model(tokens)
    with pytest.raises(RuntimeError, match="2 forwards of a MoE model reached one loss"):
        RECORDS.take()


def test_step_metrics():
    model = real_model()
    tokens = torch.randint(0, 2048, (2, 16))
    titan_loss(model, tokens, tokens).backward()
    metrics = step_metrics(None)
    assert set(metrics) == {"moe/aux_loss", "moe/tokens_per_expert_max", "moe/tokens_per_expert_mean"}
    assert metrics["moe/tokens_per_expert_mean"] == 2 * 16 * 2 / 8  # tokens x top_k over 8 experts
    assert metrics["moe/tokens_per_expert_max"] >= metrics["moe/tokens_per_expert_mean"]
    assert metrics["moe/aux_loss"] > 1.5  # E * sum f P: top_k = 2 at perfect balance
    assert step_metrics(None) == {}  # reset once logged


def test_flops_count_active_experts():
    """6 FLOPs per active weight: a token runs top_k = 2 of 8 experts."""
    a = args()
    model = meta_model(a)
    experts = sum(p.numel() for m in moe_blocks(model) for p in m.experts.parameters())
    assert idle_expert_params(model) == experts * 6 // 8
    _, dense_flops = args(num_experts_per_tok=8).get_nparams_and_flops(meta_model(args(num_experts_per_tok=8)), 80)
    _, sparse_flops = a.get_nparams_and_flops(model, 80)
    assert dense_flops - sparse_flops == 6 * experts * 6 // 8


def parallelism(disable_sequence_parallel=False, **degrees):
    base = dict(expert_parallel_degree=1, expert_tensor_parallel_degree=1, pipeline_parallel_degree=1,
                context_parallel_degree=1, tensor_parallel_degree=1)
    return SimpleNamespace(parallelism=SimpleNamespace(**{**base, **degrees}),
                           titan_ext=SimpleNamespace(disable_sequence_parallel=disable_sequence_parallel))


@pytest.mark.parametrize("degrees, phrase", [
    (dict(tensor_parallel_degree=3),  # TP without EP splits each expert's intermediate dim (32)
     "--parallelism.tensor_parallel_degree=3 does not divide the experts' intermediate size"),
    (dict(expert_parallel_degree=2, tensor_parallel_degree=3, expert_tensor_parallel_degree=3),
     "--parallelism.tensor_parallel_degree=3 does not divide the experts' intermediate size"),
    (dict(expert_parallel_degree=3), "--parallelism.expert_parallel_degree=3 does not divide the model's 8 experts"),
])  # fmt: skip
def test_moe_refusals(degrees, phrase):
    with pytest.raises(ConfigError, match=phrase):
        check_moe(meta_model(args()), parallelism(**degrees))


def test_softmax_top_k_routers_under_tp_are_refused_on_a_torch_whose_dtensor_topk_cannot_backpropagate(monkeypatch):
    """torch 2.11's DTensor backpropagates no top-k values (its backward scatters into a plain tensor: seen in the
    lower bound's runs of Qwen3-MoE and Qwen3-Next under TP); DeepSeek-V3's router gathers by the top-k's indices
    and trains there (its tp2 row passed on torch 2.11). From torch 2.13 both train (the matrix's MoE TP rows)."""
    import torch

    qwen, deepseek = meta_model(args()), meta_model(args(TINY_DEEPSEEK_V3))
    monkeypatch.setattr(torch, "__version__", "2.11.0")
    with pytest.raises(ConfigError, match=r"^--parallelism.tensor_parallel_degree=2 with Qwen3MoeTopKRouter needs torch 2.13"):
        check_moe(qwen, parallelism(tensor_parallel_degree=2))
    check_moe(qwen, parallelism(expert_parallel_degree=2))  # the router is no DTensor without TP
    check_moe(deepseek, parallelism(tensor_parallel_degree=2))
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    check_moe(qwen, parallelism(tensor_parallel_degree=2))


@pytest.mark.parametrize("degrees", [dict(context_parallel_degree=2),
                                     dict(context_parallel_degree=2, expert_parallel_degree=2),
                                     dict(pipeline_parallel_degree=2, expert_parallel_degree=2),
                                     dict(pipeline_parallel_degree=2, tensor_parallel_degree=2,
                                          disable_sequence_parallel=True),
                                     dict(pipeline_parallel_degree=2, tensor_parallel_degree=2)])
def test_cp_and_pp_with_the_balancing_loss(degrees):
    import torch

    if degrees.get("tensor_parallel_degree", 1) > 1 and torch.__version__ < "2.13":
        pytest.skip("experts under TP need torch 2.13 (refused before: the test above)")
    """CP and PP train with the balancing loss (the CP ranks count each sequence together, the stages carry
    their routers' statistics: the tests below; end to end in hf_qwen3_next's cp2, ep2_cp2 and pp2 rows and
    hf_qwen3_moe's ep2_pp2 and ep2_pp2_tp2, sequence parallel on)."""
    model = meta_model(args())
    check_moe(model, parallelism(**degrees))
    assert moe_choice(model, parallelism(**degrees)).record_routers


def test_balance_loss_under_cp_adds_up_to_the_whole_sequences(monkeypatch):
    """Two CP ranks holding head-tail pieces of each sequence (some labels ignored): their terms add up to
    the whole batch's, and so do their gradients. The CP all-reduce is played here by summing what each
    rank would send (a first pass records it)."""
    torch.manual_seed(2)
    batch, seq, experts = 2, 16, 8
    logits = [torch.randn(batch * seq, experts, requires_grad=True) for _ in range(3)]
    labels = torch.randint(0, 5, (batch, seq))
    labels[0, 3:9] = -100
    quarters = torch.arange(seq).view(4, seq // 4)
    pieces = [torch.cat([quarters[0], quarters[3]]), torch.cat([quarters[1], quarters[2]])]  # head-tail

    def rank_loss(rank):
        local = [x.view(batch, seq, experts)[:, pieces[rank]].reshape(-1, experts) for x in logits]
        return balance_loss_sum(local, labels[:, pieces[rank]], experts, 2, cp_group="cp")[0]

    sent = {}
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, group: sent.setdefault(len(sent), t.clone()))
    rank_loss(0), rank_loss(1)
    calls = iter([1, 0])
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, group: t.add_(sent[next(calls)]))
    split = rank_loss(0) + rank_loss(1)
    split_grads = torch.autograd.grad(split, logits)
    whole = balance_loss_sum(logits, labels, experts, 2)[0]
    torch.testing.assert_close(split, whole, rtol=1e-6, atol=0)
    for a, b in zip(split_grads, torch.autograd.grad(whole, logits)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def test_expert_parallel_on_a_dense_model_is_refused():
    dense = meta_model(args(mlp_only_layers=[0, 1]))
    assert moe_choice(dense) is None
    with pytest.raises(ConfigError, match="this model has no experts"):
        check_moe(dense, parallelism(expert_parallel_degree=2))
    check_moe(dense, parallelism(pipeline_parallel_degree=2))  # a dense model: PP as any other


def test_experts_beside_computeless_ones_are_named_when_ep_is_refused():
    """Zaya's router scores its experts and a computeless one (5 rows for 4 experts): not a MoE block titan_ext
    reads, so EP is refused naming those experts and why, not as a dense model."""
    from titan_ext.census.configs import tiny_config

    zaya = meta_model(args(tiny_config("zaya")))
    assert moe_blocks(zaya) == []
    with pytest.raises(ConfigError, match=r"expert_parallel_degree=2: its experts \(ZayaExperts at "
                                          r"model.layers.0.mlp.experts\) are chosen by ZayaRouter, .* computeless"):
        check_moe(zaya, parallelism(expert_parallel_degree=2))


def test_aria_experts_refuse_tp_and_ep():
    """Aria's MoE blocks are read as MoE (its router scores each expert), but its experts are not the stacked
    ``down(act(gate) * up)`` that EP and expert TP compute: the job's probe of them refuses both in one line."""
    from titan_ext.census.configs import tiny_config
    from titan_ext.host import checks

    aria = args(tiny_config("aria_text"))
    assert moe_blocks(meta_model(aria))
    checks.check_transformers_experts(aria)  # one process: the model's own experts
    with pytest.raises(ConfigError, match=r"experts \(AriaExperts\) are not the sum of down\(act\(gate\) \* up\)"):
        checks.check_transformers_experts(aria, placed=True)


def test_tensor_parallel_leaves_the_experts_to_titan_ext_moe():
    """The translated HF plan lays out a MoE block around its experts, which titan_ext.parallel.expert_parallel places:
    split over TP without EP, by EP with it."""
    from model_plans import TPOptions
    from model_plans.hf_plan import hf_plan_class
    from model_plans.styles import MoEBlockParallel

    plan_cls = hf_plan_class(meta_model(args()))
    for expert_parallel, by in ((False, "each expert's intermediate dim over TP"), (True, "expert parallelism")):
        plan = plan_cls(TPOptions(expert_parallel=expert_parallel)).block_plan(0)
        assert isinstance(plan["mlp"], MoEBlockParallel) and plan["mlp.experts"].by == by
        assert "mlp.gate" in plan


def test_a_router_is_known_by_what_it_holds_whatever_its_name():
    """gpt-oss's ``mlp.router`` (Qwen's is ``mlp.gate``): the module beside the experts with a row per expert."""
    model = meta_model(args(TINY_GPT_OSS))
    blocks = moe_blocks(model)
    assert [router_of(b) for b in blocks] == [layer.mlp.router for layer in model.model.layers]
    assert moe_choice(model).num_experts == 8 and moe_choice(model).aux_loss_coef == 0.01


def test_experts_with_biases_stay_whole_under_tp_and_refuse_ep():
    """gpt-oss's experts (biases, a clamped SwiGLU on interleaved gate/up rows) have no expert-parallel path: TP
    keeps its MoE blocks whole (its HF plan splits nothing in them), EP is refused in one line naming them."""
    model = meta_model(args(TINY_GPT_OSS))
    check_moe(model, parallelism(tensor_parallel_degree=2))
    assert not moe_choice(model, parallelism(tensor_parallel_degree=2)).split_intermediate
    with pytest.raises(ConfigError, match=r"expert_parallel_degree=2: GptOssExperts \(holding down_proj, "
                                          r"down_proj_bias, .*\) has no expert-parallel path in titan_ext"):
        check_moe(model, parallelism(expert_parallel_degree=2))


def test_tp_and_etp_choose_how_the_experts_split():
    choice = lambda **degrees: moe_choice(meta_model(args()), parallelism(**degrees))  # noqa: E731
    assert choice(tensor_parallel_degree=2).split_intermediate  # torchtitan's ep=1, tp>1
    assert not choice(tensor_parallel_degree=2, expert_parallel_degree=2).split_intermediate  # ETP=1
    assert choice(tensor_parallel_degree=2, expert_parallel_degree=2, expert_tensor_parallel_degree=2).split_intermediate
    assert not choice(expert_parallel_degree=2).split_intermediate


def _expert_parallel_rank(rank, mesh):
    """Rank ``rank`` of 2: its own 12 tokens through EP2 experts vs transformers' experts over both ranks' tokens."""
    torch.manual_seed(0)
    block = real_model().model.layers[0].mlp
    reference = copy.deepcopy(block.experts)
    torch.manual_seed(1)
    x = torch.randn(2 * 12, 64)
    _, weights, index = block.gate(x)
    cotangent = torch.randn(2 * 12, 64)
    apply_ep(block, mesh)
    mine = slice(12 * rank, 12 * (rank + 1))
    x_local = x[mine].clone().requires_grad_()
    out = block.experts(x_local, index[mine], weights[mine].detach())
    (out * cotangent[mine]).sum().backward()
    x_all = x.clone().requires_grad_()
    expected = reference(x_all, index, weights.detach())
    (expected * cotangent).sum().backward()
    local = slice(4 * rank, 4 * (rank + 1))  # this rank's 4 of 8 experts
    return {
        "local experts": block.experts.gate_up_proj.to_local().shape[0],
        "output": (out - expected[mine]).abs().max().item(),
        "input grad": (x_local.grad - x_all.grad[mine]).abs().max().item(),
        "gate_up grad": (block.experts.gate_up_proj.grad.to_local() - reference.gate_up_proj.grad[local]).abs().max().item(),
        "down grad": (block.experts.down_proj.grad.to_local() - reference.down_proj.grad[local]).abs().max().item(),
    }


def _split_intermediate_rank(folder, rank, mesh):
    """Rank ``rank`` of 2 under TP without EP: every token, every expert, its half of each expert's intermediate
    dim; then the packed gate_up_proj through DCP both ways (titan_ext.checkpoints.strided)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    block = real_model().model.layers[0].mlp
    reference = copy.deepcopy(block.experts)
    torch.manual_seed(1)
    x = torch.randn(24, 64)
    _, weights, index = block.gate(x)
    cotangent = torch.randn(24, 64)
    apply_expert_tp(block, mesh)
    x_mine, weights_mine = x.clone().requires_grad_(), weights.detach().clone().requires_grad_()
    partial = block.experts(x_mine, index, weights_mine)
    (partial * cotangent).sum().backward()
    out = partial.detach().clone()
    dist.all_reduce(out)
    x_all, weights_all = x.clone().requires_grad_(), weights.detach().clone().requires_grad_()
    expected = reference(x_all, index, weights_all)
    (expected * cotangent).sum().backward()
    half = reference.gate_up_proj.shape[1] // 4  # this rank's gate rows r and up rows r (16 of 32 each)
    rows = torch.cat([torch.arange(half) + rank * half, torch.arange(half) + 2 * half + rank * half])
    gate_up = block.experts.gate_up_proj
    diffs = {
        "output": (out - expected).abs().max().item(),
        "input grad": (x_mine.grad - x_all.grad).abs().max().item(),
        "weights grad": (weights_mine.grad - weights_all.grad).abs().max().item(),
        "local gate_up": (gate_up.to_local() - reference.gate_up_proj[:, rows]).abs().max().item(),
        "gate_up grad": (gate_up.grad.to_local() - reference.gate_up_proj.grad[:, rows]).abs().max().item(),
        "down grad": (block.experts.down_proj.grad.to_local()
                      - reference.down_proj.grad[..., rank * half:(rank + 1) * half]).abs().max().item(),
        "full tensor": (gate_up.full_tensor() - reference.gate_up_proj).abs().max().item(),
    }
    saved = block.experts.state_dict()  # what torchtitan's checkpointer saves: the full [E, 2I, H] tensor
    dcp.save(saved, checkpoint_id=f"{folder}/split")
    whole = {name: torch.zeros_like(value) for name, value in reference.state_dict().items()}
    dcp.load(whole, checkpoint_id=f"{folder}/split")
    diffs["saved"] = max((whole[n] - v).abs().max().item() for n, v in reference.state_dict().items())
    if rank == 0:
        dcp.save({name: 2 * value.detach() for name, value in reference.state_dict().items()},
                 checkpoint_id=f"{folder}/whole", no_dist=True)
    dist.barrier()
    dcp.load(saved, checkpoint_id=f"{folder}/whole")  # read in place, as torchtitan loads a seed checkpoint
    diffs["loaded"] = (gate_up.full_tensor() - 2 * reference.gate_up_proj).abs().max().item()
    # an HF export as torchtitan writes one (--checkpoint.last_save_in_hf: the adapter's to_hf, one consolidated
    # safetensors file), and its import (to_hf, the safetensors reader, from_hf, load_state_dict)
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

    from titan_ext.checkpoints.hf import HFStateDictAdapter

    adapter = HFStateDictAdapter(None, None)
    dcp.save(adapter.to_hf(saved), storage_writer=HuggingFaceStorageWriter(path=f"{folder}/hf", save_distributed=True,
                                                                           enable_consolidation=True))
    dist.barrier()
    exported = load_file(next(Path(folder, "hf").glob("*.safetensors")))
    assert sorted(exported) == ["down_proj", "gate_up_proj"], sorted(exported)
    diffs["exported"] = max((exported[n] - 2 * v).abs().max().item() for n, v in reference.state_dict().items())
    with torch.no_grad():
        gate_up.zero_()
    hf_state_dict = adapter.to_hf(block.experts.state_dict())
    dcp.load(hf_state_dict, storage_reader=HuggingFaceStorageReader(path=f"{folder}/hf"))
    block.experts.load_state_dict(adapter.from_hf(hf_state_dict))
    diffs["imported"] = (gate_up.full_tensor() - 2 * reference.gate_up_proj).abs().max().item()
    return diffs


def _ep_and_split_rank(folder, rank, mesh):
    import torch

    split = _split_intermediate_rank(folder, rank, mesh) if torch.__version__ >= "2.13" else {}  # else refused
    return {**{f"ep: {k}": v for k, v in _expert_parallel_rank(rank, mesh).items()},
            **{f"tp: {k}": v for k, v in split.items()}}


def test_experts_split_by_ep_or_over_tp_equal_the_models_own(tmp_path):
    """On 2 forked ranks (one launch for both):

    - EP2: each rank holds 4 experts, computes them for both ranks' tokens (all-to-all there and back): outputs,
      input gradients and its experts' gradients equal transformers' experts over all tokens on one process.
    - TP2 without EP (torchtitan's TP of the experts): each rank holds gate rows r and up rows r of the packed
      gate_up_proj and columns r of down_proj; the ranks' partial sums equal transformers' experts, the inputs'
      gradients are whole on each rank, and DCP saves the full tensor (an HF export too) and loads one saved whole.
    """
    from helpers import on_forked_ranks

    for rank, diffs in on_forked_ranks(2, functools.partial(_ep_and_split_rank, str(tmp_path))).items():
        assert diffs.pop("ep: local experts") == 4
        assert max(diffs.values()) < 1e-5, (rank, {k: v for k, v in diffs.items() if v >= 1e-5})


# ---------------------------------------------------------------- auxiliary-loss-free balancing (moe_balance = "bias")


def bias_choice(model):
    return moe_choice(model, SimpleNamespace(titan_ext=SimpleNamespace(moe_balance="bias"),
                                                 parallelism=parallelism().parallelism))


@pytest.mark.parametrize("base", [TINY, TINY_OLMOE], ids=["qwen3_moe", "olmoe"])
def test_a_zero_bias_routes_as_the_models_own_router(base):
    model = real_model(base=base)
    gate = model.model.layers[0].mlp.gate
    x = torch.randn(24, 64)
    own = gate(x)
    apply_expert_bias(model)
    for mine, theirs in zip(gate(x), own):
        torch.testing.assert_close(mine, theirs)
    saved = model.state_dict()  # the bias resumes with the checkpoint; the counts of a step in flight do not
    assert "model.layers.0.mlp.gate.expert_bias" in saved and "model.layers.0.mlp.gate.tokens_per_expert" not in saved


def test_the_bias_chooses_the_experts_and_the_probabilities_weigh_them():
    model = real_model()
    gate = model.model.layers[0].mlp.gate
    apply_expert_bias(model)
    x = torch.randn(24, 64)
    gate.expert_bias[3] = 10.0  # every token's first choice
    logits, weights, index = gate(x)
    assert (index == 3).any(-1).all()
    probs = F.softmax(logits, dim=-1).gather(-1, index)
    torch.testing.assert_close(weights, probs / probs.sum(-1, keepdim=True))  # norm_topk_prob
    assert gate.tokens_per_expert[3] == 24 and gate.tokens_per_expert.sum() == 24 * 2
    with torch.no_grad():  # validation counts nothing
        gate(x)
    assert gate.tokens_per_expert.sum() == 24 * 2


def test_a_recompute_in_backward_counts_nothing():
    from torch.utils.checkpoint import checkpoint

    model = real_model()
    apply_expert_bias(model)
    block = model.model.layers[0].mlp
    checkpoint(block, torch.randn(1, 4, 64, requires_grad=True), use_reentrant=False).sum().backward()
    assert block.gate.tokens_per_expert.sum() == 4 * 2


def test_the_bias_moves_toward_the_under_used_experts():
    model = real_model()
    apply_router_records(model, bias_choice(model))
    apply_expert_bias(model)
    gate = model.model.layers[0].mlp.gate
    gate.tokens_per_expert.copy_(torch.tensor([10.0, 0, 0, 0, 0, 0, 0, 6]))  # mean 2
    update_expert_bias([model], None)
    step = BIAS_RATE
    expected = torch.tensor([-step, step, step, step, step, step, step, -step]) - step * 4 / 8
    torch.testing.assert_close(gate.expert_bias, expected)
    assert gate.tokens_per_expert.sum() == 0
    metrics = step_metrics(None)
    assert "moe/aux_loss" not in metrics and metrics["moe/tokens_per_expert_max"] == 10


def _bias_rank(rank, mesh):
    """Rank ``rank`` of 2 routes its own tokens; the update sums both ranks' counts."""
    model = real_model()
    apply_router_records(model, bias_choice(model))
    apply_expert_bias(model)
    torch.manual_seed(1)
    tokens = torch.randint(0, 2048, (2, 16))
    model(tokens[rank:rank + 1])
    update_expert_bias([model], mesh.get_group())
    return torch.stack([block.mlp.gate.expert_bias for block in model.model.layers])


def test_the_bias_is_the_global_batchs_on_every_rank():
    from helpers import on_forked_ranks

    model = real_model()
    apply_router_records(model, bias_choice(model))
    apply_expert_bias(model)
    torch.manual_seed(1)
    model(torch.randint(0, 2048, (2, 16)))
    update_expert_bias([model], None)
    expected = torch.stack([block.mlp.gate.expert_bias for block in model.model.layers])
    assert expected.abs().sum() > 0
    for rank, bias in on_forked_ranks(2, _bias_rank).items():
        torch.testing.assert_close(bias, expected, rtol=0, atol=0)


@pytest.mark.parametrize("value, phrase", [
    ("biased", "--titan_ext.moe_balance='biased' is not one of aux_loss, bias"),
])  # fmt: skip
def test_moe_balance_refusals(value, phrase):
    job = parallelism()
    job.titan_ext = SimpleNamespace(moe_balance=value)
    with pytest.raises(ConfigError, match=phrase):
        check_moe(meta_model(args()), job)
    job.titan_ext.moe_balance = "bias"
    with pytest.raises(ConfigError, match="this model has no experts"):
        check_moe(meta_model(args(mlp_only_layers=[0, 1])), job)
    mixtral = {**TINY_OLMOE, "model_type": "mixtral", "num_local_experts": 8}
    with pytest.raises(ConfigError, match="moe_balance='bias': titan_ext biases transformers' softmax top-k routers"):
        check_moe(meta_model(args(mixtral)), job)
    job.checkpoint = SimpleNamespace(initial_load_in_hf=False, last_save_in_hf=True)
    with pytest.raises(ConfigError, match="moe_balance='bias' with --checkpoint.last_save_in_hf: transformers' qwen3_moe"):
        check_moe(meta_model(args()), job)
    job.checkpoint.last_save_in_hf = False
    job.parallelism.pipeline_parallel_degree = 2  # the bias under PP: each stage's routers (hf_moe_bias pp2)
    check_moe(meta_model(args()), job)


@pytest.mark.parametrize("grouped", [True, False], ids=["torch_grouped_mm", "transformers_fallback"])
@pytest.mark.parametrize("counts", [[3, 0, 5, 4], [0, 0, 0, 0]], ids=["uneven", "no_rows"])
def test_grouped_gemm_equals_a_loop_over_experts(counts, grouped, monkeypatch):
    """The local experts in one grouped GEMM (torch's, or where it cannot run transformers' fallback loop):
    the outputs and gradients of each expert's own down(act(gate) * up)."""
    import transformers.integrations.moe as hf_moe

    if not grouped:
        monkeypatch.setattr(hf_moe, "_can_use_grouped_mm", lambda *a: False)
    torch.manual_seed(0)
    act = torch.nn.SiLU()
    counts = torch.tensor(counts)
    rows = torch.randn(int(counts.sum()), 16, requires_grad=True)
    gate_up, down = torch.randn(4, 2 * 8, 16, requires_grad=True), torch.randn(4, 16, 8, requires_grad=True)
    cotangent = torch.randn(rows.shape[0], 16)
    leaves = (rows, gate_up, down)

    def outputs_and_grads(compute):
        out = compute()
        (out * cotangent).sum().backward()
        result = [out.detach(), *(t.grad.clone() for t in leaves)]
        for t in leaves:
            t.grad = None
        return result

    def loop():
        outputs = []
        for expert, expert_rows in enumerate(rows.split(counts.tolist())):
            gate, up = F.linear(expert_rows, gate_up[expert]).chunk(2, dim=-1)
            outputs.append(F.linear(act(gate) * up, down[expert]))
        return torch.cat(outputs)

    mine = outputs_and_grads(lambda: _local_experts(act, rows, counts, gate_up, down))
    for got, expected in zip(mine, outputs_and_grads(loop)):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_pipeline_stages_carry_the_balancing_loss_and_its_gradient():
    """Three stages (each with a MoE layer) chained as PP chains them: the last stage's loss, and every
    parameter's gradient (the first stage's router among them), equal the whole model's; each stage counts
    its own MoE layer's tokens per expert."""
    torch.manual_seed(0)
    a = args(num_hidden_layers=3)
    whole = build_model(a)
    whole.init_weights()
    from titan_ext.parallel.pipeline import stage_model

    stages = [stage_model(whole, names) for names in (("model.embed_tokens", "model.layers.0"), ("model.layers.1",),
                                                      ("model.layers.2", "model.norm", "lm_head"))]
    tokens = torch.randint(0, 2048, (2, 12))
    labels = torch.randint(0, 2048, (2, 12))
    labels[1, :5] = -100
    loss_fn = with_balance_loss(lambda job_config: cross_entropy_sum)(None)

    def run(parts):
        choice = moe_choice(whole)
        for part in parts:
            apply_router_records(part, choice)
        hidden = tokens
        for part in parts:
            hidden = part(hidden)
        loss = loss_fn(hidden, labels)
        loss.backward()
        return loss, RECORDS.stats

    split, split_stats = run(stages)
    whole_loss, whole_stats = run([whole])
    assert split.dtype == whole_loss.dtype and split - cross_entropy_sum(whole(tokens), labels) > 0.01  # a real term
    torch.testing.assert_close(split, whole_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(split_stats, whole_stats, rtol=1e-6, atol=0)
    grads = {name: param.grad for stage in stages for name, param in stage.named_parameters()}
    for name, param in whole.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert whole.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_statistics_travel_exactly_beside_bf16_hidden_states():
    """Beside bf16 hidden states the float32 statistics travel as their bits (a cast would round them), and
    their gradient comes back the same way."""
    statistics = torch.rand(2, 3, 16, dtype=torch.float64).float().requires_grad_()
    packed = _pack(statistics, torch.bfloat16)
    assert packed.dtype == torch.bfloat16 and packed.shape[-1] == _statistics_width(8, torch.bfloat16) == 32
    hidden = torch.randn(2, 3, 4, dtype=torch.bfloat16)
    received = _unpack(torch.cat([hidden, packed], dim=-1)[..., 4:])
    assert torch.equal(received, statistics)
    weights = torch.randn(2, 3, 16)
    (received * weights).sum().backward()
    assert torch.equal(statistics.grad, weights)


def test_under_sequence_parallel_each_tp_rank_sends_the_whole_sequences_statistics():
    """PP x TP with sequence parallel: a TP rank sends its shard of the hidden states ``[B, T/2, D]`` and the
    statistics of the whole sequences (its routers saw them gathered), folded into its shard's tokens'
    channels; the next stage's TP rank unfolds them whole, exactly, and their gradient comes back to the
    routers' logits (end to end: hf_qwen3_moe's ep2_pp2_tp2 row)."""
    torch.manual_seed(0)
    choice = moe_choice(meta_model(args()))
    RECORDS.__init__()
    RECORDS.choice = choice
    tp = SimpleNamespace(size=lambda: 2)
    sender = SimpleNamespace(forward_plan=ForwardPlan(residual_layout=(tp, None)), get_output_embeddings=lambda: None)
    logits = torch.randn(2 * 8, 8, requires_grad=True)  # [B x T, experts]: the gathered sequences, T = 8
    shard = torch.randn(2, 4, 64)
    sent = _stage_end(choice, [logits], [], [0], sender, (), shard)
    assert sent.shape == (2, 4, 64 + 2 * 2 * 8)
    carried = []
    (hidden,) = _receive_statistics(choice, carried, SimpleNamespace(forward_plan=sender.forward_plan), (sent,))
    assert torch.equal(hidden, shard)
    again = logits.detach().requires_grad_()
    expected = routed_statistics([again], 8, 2, (2, 8), "cpu")[0]
    assert carried[0].shape == (2, 8, 16) and torch.equal(carried[0], expected)
    weights = torch.randn(2, 8, 16)
    (carried[0] * weights).sum().backward()
    (expected * weights).sum().backward()
    assert logits.grad.abs().sum() > 0 and torch.equal(logits.grad, again.grad)


def test_a_forward_outside_the_pipelines_microbatches_records_and_counts_nothing():
    """Under PP torch 2.13 runs each stage once for its metadata inference (on unfilled receive buffers) before
    the schedule's forwards of microbatches: that forward (``RECORDS.live`` off, ``titan_ext.parallel.pipeline``'s
    ``MicroBatchStage``) leaves no logits for a loss and counts no tokens for the routing bias."""
    tokens = torch.randint(0, 2048, (1, 8))
    recorded, biased = real_model(), real_model()
    apply_router_records(biased, bias_choice(biased))
    apply_expert_bias(biased)
    apply_router_records(recorded, moe_choice(recorded))
    gate = biased.model.layers[0].mlp.gate
    try:
        RECORDS.live = False
        recorded(tokens)
        biased(tokens)
        assert RECORDS.take() is None and gate.tokens_per_expert.sum() == 0
        RECORDS.live = True
        recorded(tokens)
        biased(tokens)
        assert RECORDS.take() is not None and gate.tokens_per_expert.sum() == 8 * 2
    finally:
        RECORDS.live = True


TINY_DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12, "first_k_dense_replace": 1,
                    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "vocab_size": 2048}
SHRUNK_QWEN3_NEXT = {"num_hidden_layers": 4, "hidden_size": 64, "num_experts": 8, "vocab_size": 2048}


@pytest.mark.parametrize("base, overrides", [
    (TINY, {}), (TINY_OLMOE, {}), (TINY_DEEPSEEK_V3, {}),
    (json.loads((REPO / "train_configs" / "kimi_linear_debug.json").read_text()), {}),
    (json.loads((REPO / "train_configs" / "qwen3_next_80b_a3b.json").read_text()), SHRUNK_QWEN3_NEXT),
], ids=["qwen3_moe", "olmoe", "deepseek_v3", "kimi_linear", "qwen3_next"])
def test_the_experts_dispatch_to_transformers_grouped_gemm(base, overrides):
    """titan_ext's model classes (made in ``adapter.titan_class``) run their experts in transformers' grouped GEMMs
    as the HF classes do: transformers allows it only for a class whose module's source it finds its decorator in,
    and else loops over the experts ("eager": one Python step and one stacked-weight-sized gradient per expert)."""
    with torch.device("meta"):
        model = build_model(args(base, **overrides))
    from titan_ext.planner import experts as planned

    assert moe_blocks(model)
    assert model.config._experts_implementation == "grouped_mm"
    assert {planned._implementation(block.experts) for block in moe_blocks(model)} == {"grouped_mm"}  # planned so


def test_grouped_experts_equal_the_models_loop(monkeypatch):
    """A step of titan_ext's Qwen3-MoE runs every MoE layer's two expert matmuls grouped (not per expert), with the
    logits and gradients of the model's own loop over the experts."""
    import transformers.integrations.moe as hf_moe

    grouped = hf_moe._grouped_mm
    calls = []
    monkeypatch.setattr(hf_moe, "_grouped_mm", lambda *a, **kw: calls.append(1) or grouped(*a, **kw))
    torch.manual_seed(0)
    model = build_model(args()).float()
    looped = copy.deepcopy(model)
    looped.set_experts_implementation("eager")
    tokens = torch.randint(0, TINY["vocab_size"], (2, 32))
    cotangent = torch.randn(2, 32, TINY["vocab_size"])
    results = []
    for m in (model, looped):
        logits = m(tokens)
        (logits * cotangent).sum().backward()
        results.append([logits.detach(), *(p.grad for p in m.parameters())])
    assert len(calls) == 2 * len(moe_blocks(model))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
