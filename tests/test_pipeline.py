"""Pipeline stages of HF-layout models, in one process: names, balance, and the chained forward.

Training under PP (1F1B, Interleaved1F1B, ZBVZeroBubble, with FSDP2, resume, HF export) runs in the
integration matrix (``pp2*`` rows), against one process. A tied embedding and head (a copy on the first and
the last stage) trains here on two forked ranks against one process: the copies' gradients, the clip norm,
the weights, the checkpoint's keys.
"""

import copy
from types import SimpleNamespace

import pytest
import torch
from torch.torch_version import TorchVersion

from titan_ext.errors import ConfigError
from titan_ext.models.adapter import build_model
from titan_ext.models.gla import gla_flavors
from titan_ext.models.llama import llama_flavors
from titan_ext.parallel.pipeline import StageLayers, stage_model
from titan_ext.parallel.pipeline_plan import pp_choice

FLAVORS = {"fla_gla": gla_flavors, "hf_llama": llama_flavors}


def debug_args(spec: str, layers: int = 4):
    args = copy.deepcopy(FLAVORS[spec]["debugmodel"])
    args.config.update(num_hidden_layers=layers, tie_word_embeddings=False)
    return args


def job(degree=2, schedule="1F1B", per_stage=None, first=1, last=1, batch=4):
    p = SimpleNamespace(
        pipeline_parallel_degree=degree, pipeline_parallel_schedule=schedule, pipeline_parallel_microbatch_size=1,
        pipeline_parallel_layers_per_stage=per_stage, pipeline_parallel_first_stage_less_layers=first,
        pipeline_parallel_last_stage_less_layers=last, module_fqns_per_model_part=None,
        data_parallel_shard_degree=1, data_parallel_replicate_degree=1, tensor_parallel_degree=1,
        context_parallel_degree=1, expert_parallel_degree=1, pipeline_parallel_expert_parallel_overlap=False,
    )
    return SimpleNamespace(parallelism=p, training=SimpleNamespace(local_batch_size=batch, global_batch_size=-1, seq_len=128),
                           validation=SimpleNamespace(enable=False))


def test_stages_are_balanced_in_the_models_own_names(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)  # V schedules on any torch
    with torch.device("meta"):
        model = build_model(debug_args("fla_gla"))
    choice = pp_choice(model, job(), world_size=2)
    assert choice.stages == (("model.embeddings", "model.layers.0", "model.layers.1"),
                             ("model.layers.2", "model.layers.3", "model.norm", "lm_head"))
    looped = pp_choice(model, job(schedule="Interleaved1F1B"), world_size=2)
    assert len(looped.stages) == 4 and looped.stage_indices(1) == (1, 3)
    v_shape = pp_choice(model, job(schedule="ZBVZeroBubble"), world_size=2)
    assert v_shape.stage_indices(0) == (0, 3) and v_shape.stage_indices(1) == (1, 2)


@pytest.mark.parametrize("schedule,batch,refused", [
    ("1F1B", 1, "needs at least one microbatch per stage: 1 microbatch\\(es\\) for"),
    ("1F1B", 2, None),
    ("Interleaved1F1B", 5, "5 microbatches are not a multiple of its 2 rounds"),
    ("Interleaved1F1B", 4, None),
    ("InterleavedZeroBubble", 7, "7 microbatches are not a multiple of its 3 rounds"),
])
def test_microbatch_counts_torch_refuses_after_the_build_stop_before_it(schedule, batch, refused):
    """torch's schedules assert these when torchtitan builds them, after the model (a planner's sweep met it)."""
    with torch.device("meta"):
        model = build_model(debug_args("fla_gla"))
    if refused is None:
        assert pp_choice(model, job(schedule=schedule, batch=batch), world_size=2)
        return
    with pytest.raises(ConfigError, match=refused):
        pp_choice(model, job(schedule=schedule, batch=batch), world_size=2)


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_a_v_schedule_on_gloo_before_torch_2_13_is_refused(monkeypatch, schedule):
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    with torch.device("meta"):
        model = build_model(debug_args("fla_gla"))
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.11.0+cu130"))
    with pytest.raises(ConfigError, match=f"schedule='{schedule}' on CPU \\(gloo\\) needs torch 2.13 or later"):
        pp_choice(model, job(schedule=schedule), world_size=2)
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.13.0+cpu"))
    assert pp_choice(model, job(schedule=schedule), world_size=2).v_shape


@pytest.mark.parametrize("spec", list(FLAVORS))
def test_stages_hold_the_whole_models_names_once_and_chain_to_its_forward(spec):
    """A PP checkpoint names the whole model's tensors (DCP loads it at any PP degree), and the stages in
    order compute what the whole model computes."""
    torch.manual_seed(0)
    whole = build_model(debug_args(spec)).double()
    whole.init_weights()
    split = [("model.embed_tokens" if spec == "hf_llama" else "model.embeddings", "model.layers.0"),
             ("model.layers.1", "model.layers.2"), ("model.layers.3", "model.norm", "lm_head")]
    stages = [stage_model(whole, names) for names in split]
    names = [name for stage in stages for name, _ in stage.named_parameters()]
    assert sorted(names) == sorted(name for name, _ in whole.named_parameters()) and len(names) == len(set(names))
    assert isinstance(stages[1].get_decoder().layers, StageLayers) and len(stages[1].get_decoder().layers) == 2
    tokens = torch.randint(0, 2048, (2, 80), generator=torch.Generator().manual_seed(1))
    hidden = tokens
    for stage in stages:
        hidden = stage(hidden)
    torch.testing.assert_close(hidden, whole(tokens), rtol=1e-12, atol=1e-12)


# ---- tied embeddings (Llama 3.2, Qwen3 0.6-4B, Gemma): a copy of the weight on the first and the last stage ----


def tied_llama(layers: int = 2):
    args = copy.deepcopy(FLAVORS["hf_llama"]["debugmodel"])
    args.config.update(num_hidden_layers=layers, tie_word_embeddings=True)
    return args


def test_a_tied_heads_stage_holds_the_embedding_as_the_weights_owner():
    """The last stage's head shares the weight of an embedding it never runs: its parameters and state dict name
    the weight as one process does, once (no ``lm_head.weight`` key), and the stages chain to the whole forward."""
    torch.manual_seed(0)
    whole = build_model(tied_llama()).double()
    whole.init_weights()
    first, last = (stage_model(whole, names) for names in (("model.embed_tokens", "model.layers.0"),
                                                           ("model.layers.1", "model.norm", "lm_head")))
    assert first.lm_head is None and not first.structure.takes_hidden_states and last.structure.takes_hidden_states
    assert last.lm_head.weight is last.get_input_embeddings().weight
    assert [n for n, _ in last.named_parameters()][0] == "model.embed_tokens.weight"
    for model in (whole, first, last):
        keys = set(model.state_dict())
        assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(last(first(tokens)), whole(tokens), rtol=1e-12, atol=1e-12)


BATCH = 4
"""A microbatch of 1 per stage of the 4-stage pipelines."""
MAX_NORM = 0.5
"""Below the gradients' norm (about 1.5): clipping scales every step, so a norm counted twice would show."""


def _tied_pipeline_run(rank, mesh, schedule_name, folder):
    """2 ranks train a tied Llama's stages for 2 steps; one process trains the whole model alongside. Returns the
    worst relative differences (copies vs each other, vs one process) and what the checkpoint holds."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torchtitan.distributed import utils as dist_utils

    from titan_ext.job_plan import PPChoice
    from titan_ext.parallel import host_patches
    from titan_ext.parallel.pipeline import TiedWeight, TokenMeanSchedule
    from titan_ext.parallel.pipeline_plan import model_parts_of

    torch.manual_seed(0)
    whole = build_model(tied_llama()).double()
    whole.init_weights()
    v_shape, degree = schedule_name == "ZBVZeroBubble", mesh.size()
    names = ((("model.embed_tokens",), ("model.layers.0",), ("model.layers.1",), ("model.norm", "lm_head")) if v_shape
             or degree == 4 else (("model.embed_tokens", "model.layers.0"), ("model.layers.1", "model.norm", "lm_head")))
    choice = PPChoice(degree, schedule_name, 1, names, v_shape)
    parts = [stage_model(whole, names[i]) for i in choice.stage_indices(rank)]
    with torch.no_grad():  # torchtitan seeds each pipeline rank differently: the copies start apart
        for part in parts:
            if part.get_input_embeddings() is not None:
                part.get_input_embeddings().weight.normal_(generator=torch.Generator().manual_seed(100 + rank))
        whole.get_input_embeddings().weight.normal_(generator=torch.Generator().manual_seed(100))  # rank 0's
    stages = [PipelineStage(part, i, len(names), torch.device("cpu"), group=mesh.get_group())
              for part, i in zip(parts, choice.stage_indices(rank))]
    tied = TiedWeight.of(choice, mesh, stages, parts, (model_parts_of(whole)[0], model_parts_of(whole)[3]))
    mine = (lambda: tied.copies) if tied is not None else list  # a V's rank 1 holds no copy

    def loss_fn(pred, labels):
        return F.cross_entropy(pred.flatten(0, 1), labels.flatten(), reduction="sum")

    schedule = TokenMeanSchedule(loss_fn, None, parts, warm_up=True, pp_group=mesh.get_group(), tied=tied)
    schedule_class = get_schedule_class(schedule_name)
    schedule.wrap(schedule_class(stages if v_shape else stages[0], n_microbatches=BATCH, loss_fn=schedule.loss_fn,
                                 scale_grads=False))
    clip = host_patches._tied_weight_counted_once(dist_utils.clip_grad_norm_)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (*parts, whole)]
    worst = {"copies": 0.0, "grad vs one process": 0.0, "norm vs one process": 0.0, "weights vs one process": 0.0}

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    def copies(tensors):  # the tied weight's copies (or their gradients) on both ranks
        gathered = [None] * degree
        dist.all_gather_object(gathered, [t.detach().clone() for t in tensors])
        return [t for ts in gathered for t in ts]

    for step in range(2):
        g = torch.Generator().manual_seed(10 + step)
        tokens, labels = (torch.randint(0, 2048, (BATCH, 16), generator=g) for _ in range(2))
        for optimizer in optimizers:
            optimizer.zero_grad()
        (loss_fn(whole(tokens), labels) / labels.numel()).backward()
        expected_norm = torch.nn.utils.get_total_norm([p.grad for p in whole.parameters()])
        torch.nn.utils.clip_grads_with_norm_(list(whole.parameters()), MAX_NORM, expected_norm)
        first = rank == 0
        last = rank == 0 if v_shape else rank == degree - 1
        schedule.step(*([tokens] if first else []), target=labels if last else None, losses=[] if last else None)
        norm = clip([p for part in parts for p in part.parameters()], MAX_NORM, foreach=True, pp_mesh=mesh)
        grads = copies([p.grad for p in mine()])
        expected_grad = whole.get_input_embeddings().weight.grad
        worst["copies"] = max(worst["copies"], *(rel(g, grads[0]) for g in grads))
        worst["grad vs one process"] = max(worst["grad vs one process"], rel(grads[0], expected_grad))
        worst["norm vs one process"] = max(worst["norm vs one process"], abs(norm.item() / expected_norm.item() - 1))
        for optimizer in optimizers:
            optimizer.step()
    weights = copies(mine())
    worst["copies"] = max(worst["copies"], *(rel(w, weights[0]) for w in weights))
    worst["weights vs one process"] = rel(weights[0], whole.get_input_embeddings().weight.detach())
    model_state = {k: v for part in parts for k, v in get_model_state_dict(part).items()}
    optimizer_state = {k: v for part, o in zip(parts, optimizers) for k, v in get_optimizer_state_dict(part, o)["state"].items()}
    dcp.save(model_state, checkpoint_id=folder)
    saved = sorted(dcp.FileSystemReader(folder).read_metadata().state_dict_metadata)
    tied_keys = {"model": sorted(k for k in saved if "embed" in k or "lm_head" in k),
                 "optimizer": sorted(k for k in optimizer_state if "embed" in k or "lm_head" in k)}
    return worst, tied_keys


@pytest.mark.parametrize("schedule,degree", [("1F1B", 2), ("ZBVZeroBubble", 2), ("1F1B", 4)])
def test_tied_copies_on_pipeline_ranks_train_as_one_weight(schedule, degree, tmp_path):
    """1F1B: the copies on rank 0 (embedding) and the last rank (head) sum their gradients over those two (at PP=4
    a subgroup of the pipeline); ZBV: rank 0 holds both (a V). The copies start from rank 0's values although each rank drew its own, their gradients are
    equal and equal to one process's tied gradient, the clip norm counts the weight once (one process's norm),
    the weights after 2 clipped AdamW steps equal one process's, and the checkpoint names the weight once."""
    if schedule == "ZBVZeroBubble" and torch.__version__ < "2.13":
        pytest.skip("torch < 2.13's V-shaped schedules stall on gloo (titan_ext refuses them there in one line)")
    import functools

    from helpers import on_forked_ranks

    results = on_forked_ranks(degree, functools.partial(_tied_pipeline_run, schedule_name=schedule, folder=str(tmp_path)))
    for rank, (worst, keys) in results.items():
        assert all(value <= 1e-10 for value in worst.values()), (rank, worst)
        assert keys["model"] == ["model.embed_tokens.weight"], keys  # the DCP checkpoint's metadata
    assert {key for _, keys in results.values() for key in keys["optimizer"]} == {"model.embed_tokens.weight"}
