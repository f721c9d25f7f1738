"""Gated DeltaNet's TP plan, and short convolutions under TP (GDN's by default, GLA's with use_short_conv).

On torch's fake 2-rank group: the collectives one block issues, and that every
parameter (conv weights, A_log, dt_bias included) becomes a DTensor of the
global shape and trains. On two real gloo ranks: the same loss and gradients as
one process. Then ``validate_tp``'s one-line errors.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import assert_rel_close, on_forked_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from model_plans import TPOptions, apply_tp, validate_tp
from titan_ext import kernels
from titan_ext.kernels import tp_local

TP = 2
VOCAB = 128


def gdn_config(**kw):
    from fla.models import GatedDeltaNetConfig

    base = dict(hidden_size=64, num_hidden_layers=1, num_heads=4, head_dim=16, expand_v=1.0, vocab_size=VOCAB,
                fuse_cross_entropy=False, fuse_linear_cross_entropy=False)
    return GatedDeltaNetConfig(**{**base, **kw})


def tiny_gdn(**kw):
    from fla.models import GatedDeltaNetForCausalLM

    return kernels.portable(GatedDeltaNetForCausalLM(gdn_config(**kw)))


def tiny_gla(**kw):
    from fla.models import GLAConfig, GLAForCausalLM

    config = GLAConfig(hidden_size=64, num_hidden_layers=1, num_heads=4, vocab_size=VOCAB,
                       fuse_cross_entropy=False, fuse_linear_cross_entropy=False, **kw)
    return kernels.portable(GLAForCausalLM(config))


BUILDERS = {
    "gdn": tiny_gdn,  # short convolutions on (fla's default)
    "gdn_grouped": lambda: tiny_gdn(num_v_heads=8),  # two value heads per query/key head
    "gdn_no_conv_no_gate": lambda: tiny_gdn(use_short_conv=False, use_gate=False),  # o_norm without its gate
    "gla_conv": lambda: tiny_gla(use_short_conv=True),
}


def plan_for(model, sp=True, loss_parallel=True):
    from titan_ext.parallel.tensor_parallel import tp_plan_class

    return tp_plan_class(model, 2)(TPOptions(sequence_parallel=sp, loss_parallel=loss_parallel))


def test_the_plan_is_the_mixers_own_entries():
    """No plan is registered for fla's model types: fla's block names, each layer's mixer its own entries."""
    plan = plan_for(meta_gdn())
    assert type(plan).__name__ == "FlaTPPlan" and "attn.a_proj" in plan.block_plan(0), plan.block_plan(0)


# ---- a fake 2-rank group ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    yield init_device_mesh("cpu", (TP,))
    dist.destroy_process_group()


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no_sp"])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_one_block_issues_the_megatron_minimum(mesh, name, sp):
    """Sharded convs, A_log and dt_bias add no collective: their kernels read the local shards."""
    model = BUILDERS[name]()
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
    for sp in (True, False):
        model = BUILDERS[name]()
        shapes = {n: p.shape for n, p in model.named_parameters()}
        apply_tp(model, mesh, plan_for(model, sp, loss_parallel=False))
        assert {n: p.shape for n, p in model.named_parameters()} == shapes  # DCP sees global shapes
        attn = model.model.layers[0].attn
        sharded = [m.weight for m in (getattr(attn, f"{x}_conv1d", None) for x in "qkv") if m is not None]
        sharded += [getattr(attn, n) for n in ("A_log", "dt_bias") if hasattr(attn, n)]
        assert all(p.placements == (Shard(0),) for p in sharded)
        logits = model.lm_head(model.model(input_ids=torch.randint(0, VOCAB, (2, 16))).last_hidden_state)
        assert logits.shape == (2, 16, VOCAB) and not isinstance(logits, DTensor)
        logits.float().pow(2).mean().backward()
        assert all(isinstance(p.grad, DTensor) and p.grad.shape == p.shape for p in model.parameters())
        with torch.no_grad():  # evaluation takes the decoding kernels (fused_recurrent_*)
            assert model.eval()(input_ids=torch.randint(0, VOCAB, (2, 16))).logits.shape[:2] == (2, 16)


def test_fused_qkv_conv_runs_without_tp_only(mesh):
    """fla's fused q/k/v conv concatenates the weights and splits by global widths: off for shards."""
    model = tiny_gdn()
    attn = model.model.layers[0].attn
    assert attn._use_fused_qkv_conv(last_state=None, use_cache=False, cu_seqlens=None)
    apply_tp(model, mesh, plan_for(model, sp=True))
    assert not attn._use_fused_qkv_conv(last_state=None, use_cache=False, cu_seqlens=None)


def test_fla_path_gives_fla_kernels_local_shards(mesh):
    """On CUDA fla's own kernels run (inside torch ops where a training block reaches them), called with each
    DTensor argument's local shard."""
    import fla.modules.causal_conv1d.ops as conv_ops
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    from titan_ext.kernels import conv_op, gated_delta_op

    fla_path = kernels.replacements("fla")
    for fla_fn in (conv_ops.causal_conv1d_update, fused_recurrent_gated_delta_rule):
        assert fla_path[fla_fn].__wrapped__ is fla_fn
    assert fla_path[chunk_gated_delta_rule] is gated_delta_op.chunk_gated_delta_rule  # local shards, then the op
    from fla.models import GatedDeltaNetForCausalLM  # a model bound to the fla path reaches the wrappers

    attn = kernels.bind(GatedDeltaNetForCausalLM(gdn_config()), "fla").model.layers[0].attn
    assert attn.forward.__globals__["chunk_gated_delta_rule"] is gated_delta_op.chunk_gated_delta_rule
    assert attn.forward.__globals__["causal_conv1d"] is conv_op.causal_conv1d
    conv_forward = type(attn.q_conv1d).forward  # fla's forward, traced by compile, rebound to the op
    assert not getattr(conv_forward, "_torchdynamo_disable", False)
    assert conv_forward.__globals__["causal_conv1d"] is conv_op.causal_conv1d
    assert type(attn)._use_fused_qkv_conv is tp_local.use_fused_qkv_conv
    seen = []
    shard = DTensor.from_local(torch.ones(3), mesh, (Shard(0),))
    plain = torch.zeros(2)
    tp_local.with_local_args(lambda *a, **kw: seen.extend([*a, *kw.values()]))(shard, plain, 1, A_log=shard)
    assert [type(x) for x in seen] == [torch.Tensor, torch.Tensor, int, torch.Tensor]
    assert seen[0].shape == (3,) and seen[1] is plain


# ---- two real gloo ranks -----------------------------------------------------------------------------

EXACT_CASES = [(name, sp, packed) for name, packed in [("gdn", False), ("gdn_grouped", False), ("gla_conv", False),
                                                          ("gdn", True)] for sp in (True, False)]
"""(model, sequence parallel, packed documents): ``packed`` runs one row of two documents with
``cu_seqlens`` (the per-conv path; unpacked GDN would take fla's fused conv path without TP)."""
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
    """Every case's TP=2 run and its one-process reference, on one rank."""
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


# ---- validation ---------------------------------------------------------------------------------------

DEGREE = "is not divisible by --parallelism.tensor_parallel_degree"


def meta_gdn(**kw):
    from fla.models import GatedDeltaNetForCausalLM

    with torch.device("meta"):
        return GatedDeltaNetForCausalLM(gdn_config(**kw))


@pytest.mark.parametrize(
    "kw,degree,expected",
    [
        (dict(num_heads=6, head_dim=16, num_v_heads=12), 4, f"num_heads=6 {DEGREE}=4"),
        # a degree dividing num_heads divides a larger num_v_heads (fla needs a multiple): reached with fewer only
        (dict(num_heads=4, num_v_heads=2), 4, f"num_v_heads=2 {DEGREE}=4"),
        (dict(intermediate_size=130), 4, f"model.layers.0.mlp.gate_proj.out_features=130 {DEGREE}=4"),
    ],
)
def test_validation_is_one_line_naming_the_field(kw, degree, expected):
    with pytest.raises(ValueError) as e:
        model = meta_gdn(**kw)
        validate_tp(model, plan_for(model), degree, None)
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_validation_passes_short_convolutions_and_grouped_values():
    for model, degree in ((meta_gdn(), 2), (meta_gdn(num_v_heads=8), 4), (meta_gdn(use_short_conv=False, use_gate=False), 2)):
        validate_tp(model, plan_for(model), degree, 128)


def test_validation_sees_a_plan_without_the_per_head_parameters():
    model = meta_gdn()

    class NoHeadParameters(type(plan_for(model))):
        def block_plan(self, index=None):
            plan = super().block_plan(index)
            plan["attn"] = plan["attn"].styles[0]  # the input gather only
            return plan

    with pytest.raises(ValueError, match=r"parameter model.layers.0.attn.A_log is not covered by NoHeadParameters"):
        validate_tp(model, NoHeadParameters(), 2)
