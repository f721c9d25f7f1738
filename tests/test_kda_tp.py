"""KDA's TP plan (the KDA mixer's own entries, ``titan_ext.models.mixers.kda``): on torch's fake 2-rank group, the collectives one block
issues and that every parameter (convs, ``A_log``, ``dt_bias``, the low-rank gates) becomes a DTensor of
the global shape and trains; on two real gloo ranks, the same losses and gradients as one process."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import assert_rel_close, on_forked_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from model_plans import TPOptions, apply_tp, validate_tp
from titan_ext import kernels
from titan_ext.kernels import kda_op, tp_local

TP = 2
VOCAB = 128


def kda_config(**kw):
    from fla.models import KDAConfig

    base = dict(hidden_size=64, num_hidden_layers=1, num_heads=4, head_dim=16, vocab_size=VOCAB,
                fuse_cross_entropy=False, fuse_linear_cross_entropy=False)
    return KDAConfig(**{**base, **kw})


def tiny_kda(**kw):
    from fla.models import KDAForCausalLM

    return kernels.portable(KDAForCausalLM(kda_config(**kw)))


BUILDERS = {
    "kda": tiny_kda,  # short convolutions on (fla's default)
    "kda_grouped": lambda: tiny_kda(num_v_heads=8),  # two value heads per query/key head
    "kda_bounded_no_conv": lambda: tiny_kda(use_short_conv=False, safe_gate=True, lower_bound=-5.0),
}


def plan_for(model, sp=True, loss_parallel=True):
    from titan_ext.parallel.tensor_parallel import tp_plan_class

    return tp_plan_class(model, 2)(TPOptions(sequence_parallel=sp, loss_parallel=loss_parallel))


def test_the_plan_is_the_mixers_own_entries():
    """No plan is registered for fla's model types: fla's block names, each layer's mixer its own entries."""
    from fla.models import KDAForCausalLM

    with torch.device("meta"):
        plan = plan_for(KDAForCausalLM(kda_config()))
    assert type(plan).__name__ == "FlaTPPlan" and "attn.f_proj.1" in plan.block_plan(0), plan.block_plan(0)


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    yield init_device_mesh("cpu", (TP,))
    dist.destroy_process_group()


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no_sp"])
def test_one_block_issues_the_megatron_minimum(mesh, sp):
    """Sharded convs, A_log and dt_bias and the replicated low-rank down-projections add no collective."""
    model = tiny_kda()
    plan = plan_for(model, sp)
    apply_tp(model, mesh, plan)
    hidden = model.get_input_embeddings()(torch.randint(0, VOCAB, (2, 16)))
    block = model.get_submodule(plan.layers)[0]
    with CommDebugMode() as comm:
        out = block(hidden)[0]
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    assert counts == ({"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2} if sp else {"all_reduce": 2})
    assert out.shape[-1] == 64


@pytest.mark.parametrize("name", list(BUILDERS))
def test_every_parameter_becomes_a_global_dtensor_and_trains(mesh, name):
    model = BUILDERS[name]()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    apply_tp(model, mesh, plan_for(model, sp=True, loss_parallel=False))
    assert {n: p.shape for n, p in model.named_parameters()} == shapes  # DCP sees global shapes
    attn = model.model.layers[0].attn
    sharded = [m.weight for m in (getattr(attn, f"{x}_conv1d", None) for x in "qkv") if m is not None]
    sharded += [attn.A_log, attn.dt_bias, attn.f_proj[1].weight, attn.g_proj[1].weight, attn.b_proj.weight]
    assert all(p.placements == (Shard(0),) for p in sharded)
    assert all(p.placements == (Replicate(),) for p in (attn.f_proj[0].weight, attn.g_proj[0].weight))
    logits = model.lm_head(model.model(input_ids=torch.randint(0, VOCAB, (2, 16))).last_hidden_state)
    assert logits.shape == (2, 16, VOCAB) and not isinstance(logits, DTensor)
    logits.float().pow(2).mean().backward()
    assert all(isinstance(p.grad, DTensor) and p.grad.shape == p.shape for p in model.parameters())
    with torch.no_grad():  # evaluation takes the decoding kernel (fused_recurrent_kda)
        assert model.eval()(input_ids=torch.randint(0, VOCAB, (2, 16))).logits.shape[:2] == (2, 16)


def test_fla_path_gives_fla_kernels_local_shards():
    """On CUDA fla's own KDA kernels run, called with each DTensor argument's local shard (``chunk_kda`` through
    titan_ext's torch ops around fla's drivers, ``kda_op``)."""
    from fla.models import KDAForCausalLM
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    fla_path = kernels.replacements("fla")
    assert fla_path[fused_recurrent_kda].__wrapped__ is fused_recurrent_kda
    assert fla_path[chunk_kda].__wrapped__ is kda_op._through_ops
    attn = kernels.bind(KDAForCausalLM(kda_config()), "fla").model.layers[0].attn
    assert attn.forward.__globals__["chunk_kda"] is kda_op.chunk_kda
    assert attn.forward.__globals__["fused_recurrent_kda"] is tp_local.fused_recurrent_kda


def test_validation_names_the_head_count():
    from fla.models import KDAForCausalLM

    with torch.device("meta"):
        model = KDAForCausalLM(kda_config(num_heads=6, head_dim=16))
    with pytest.raises(ValueError, match="num_heads=6 is not divisible by --parallelism.tensor_parallel_degree=4"):
        validate_tp(model, plan_for(model), 4, None)
    validate_tp(model, plan_for(model), 2, 128)


# ---- two real gloo ranks -----------------------------------------------------------------------------

EXACT_CASES = [("kda", True, False), ("kda", False, False), ("kda_grouped", True, False), ("kda", True, True),
               ("kda_bounded_no_conv", False, False)]
"""(model, sequence parallel, packed documents): ``packed`` runs one row of two documents with ``cu_seqlens``."""
STEPS, LR = 2, 0.5


def _loss(model, packed):
    generator = torch.Generator().manual_seed(1)
    if packed:
        tokens = torch.randint(0, VOCAB, (1, 40), generator=generator)
        kwargs = {"cu_seqlens": torch.tensor([0, 13, 40])}
    else:
        tokens, kwargs = torch.randint(0, VOCAB, (2, 32), generator=generator), {}
    logits = model(input_ids=tokens, **kwargs).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def _full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _compare(name, sp, packed, mesh):
    """Losses before each of ``STEPS`` SGD steps and the first gradients: TP=2 and one process."""
    torch.manual_seed(0)
    whole = BUILDERS[name]()
    model = copy.deepcopy(whole)
    apply_tp(model, mesh, plan_for(model, sp, loss_parallel=False))
    results = []
    for m in (whole, model):
        optimizer = torch.optim.SGD(m.parameters(), lr=LR)
        losses, grads = [], None
        for _ in range(STEPS):
            optimizer.zero_grad()
            loss = _loss(m, packed)
            loss.backward()
            losses.append(loss.detach())
            grads = grads or {n: _full(p.grad) for n, p in m.named_parameters()}
            optimizer.step()
        results.append((torch.stack(losses), grads))
    return results


def _all_cases(rank, mesh):
    return {case: _compare(*case, mesh) for case in EXACT_CASES}


def test_two_ranks_equal_one_process():
    """fp32 losses (over two SGD steps) and gradients of TP=2 on gloo match one process within 1e-5."""
    results = on_forked_ranks(TP, _all_cases)
    for case in EXACT_CASES:
        for rank in range(TP):
            (ref_losses, ref_grads), (losses, grads) = results[rank][case]
            assert_rel_close(losses, ref_losses, 1e-5, f"{case} rank {rank} losses")
            for param, ref in ref_grads.items():
                assert_rel_close(grads[param], ref, 1e-5, f"{case} rank {rank} {param}.grad")
