"""Pipeline stages of HF-layout models, in one process: names, balance, and the chained forward.

Training under PP (1F1B, Interleaved1F1B, ZBVZeroBubble, with FSDP2, resume, HF export) runs in the
integration matrix (``pp2*`` rows), against one process.
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
from titan_ext.pipeline import StageLayers, pp_choice, stage_model

FLAVORS = {"fla_gla": gla_flavors, "hf_llama": llama_flavors}


def debug_args(spec: str, layers: int = 4):
    args = copy.deepcopy(FLAVORS[spec]["debugmodel"])
    args.config.update(num_hidden_layers=layers, tie_word_embeddings=False)
    return args


def job(degree=2, schedule="1F1B", per_stage=None, first=1, last=1):
    p = SimpleNamespace(
        pipeline_parallel_degree=degree, pipeline_parallel_schedule=schedule, pipeline_parallel_microbatch_size=1,
        pipeline_parallel_layers_per_stage=per_stage, pipeline_parallel_first_stage_less_layers=first,
        pipeline_parallel_last_stage_less_layers=last, module_fqns_per_model_part=None,
        data_parallel_shard_degree=1, data_parallel_replicate_degree=1, tensor_parallel_degree=1,
        context_parallel_degree=1, expert_parallel_degree=1, pipeline_parallel_expert_parallel_overlap=False,
    )
    return SimpleNamespace(parallelism=p, training=SimpleNamespace(local_batch_size=4, global_batch_size=-1, seq_len=128),
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
