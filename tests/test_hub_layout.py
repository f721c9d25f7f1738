"""HF folders in the hub's own layout (``titan_ext.checkpoints.hub_layout``), in one process: what a transformers
``save_pretrained`` folder imports as, and what an export writes back.

The same under FSDP2, TP2 and EP2 through torchtitan, against transformers' own forward: the integration
matrix's ``hub_*`` rows.
"""

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from integration_matrix import CONFIGS, TINY_QWEN3, TINY_QWEN3_MOE, write_hub_folder
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank
from transformers import AutoModelForCausalLM

import titan_ext  # noqa: F401  (train specs)
from titan_ext.checkpoints import hub_layout
from titan_ext.checkpoints.hf import HFStateDictAdapter, finish_hf_export
from titan_ext.errors import ConfigError
from titan_ext.models.adapter import build_model, meta_model
from titan_ext.models.args import transformers_model

KIMI_LINEAR = json.loads((CONFIGS / "kimi_linear_debug.json").read_text())
LAYOUTS = {"qwen3_moe": TINY_QWEN3_MOE, "kimi_linear": KIMI_LINEAR, "qwen3_tied": TINY_QWEN3}


def model_args(config):
    return transformers_model(**{k: v for k, v in config.items() if k != "architectures"})


def folder_tensors(folder) -> dict:
    return {k: v for name in sorted(os.listdir(folder)) if name.endswith(".safetensors")
            for k, v in load_file(os.path.join(folder, name)).items()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_save_pretrained_folder_imports_as_from_pretrained_and_exports_as_saved(layout, tmp_path):
    hub = tmp_path / "hub"
    write_hub_folder(LAYOUTS[layout], hub)
    args = model_args(LAYOUTS[layout])
    model = build_model(args)
    adapter = HFStateDictAdapter(args, str(hub))  # the hub's index: the export is sharded as the folder
    state = adapter.to_hf(model.state_dict())
    dcp.load(state, storage_reader=adapter.get_hf_storage_reader(str(hub)), no_dist=True)
    model.load_state_dict(adapter.from_hf(state), strict=False)
    reference = AutoModelForCausalLM.from_pretrained(hub).state_dict()
    differ = [key for key, value in model.state_dict().items() if not torch.equal(value, reference[key])]
    assert not differ, differ

    step = tmp_path / "out" / "step-1"  # as torchtitan's last_save_in_hf writes it, then the job's close
    writer = HuggingFaceStorageWriter(path=str(step / "sharded"), save_distributed=True,
                                      fqn_to_index_mapping=adapter.fqn_to_index_mapping, enable_consolidation=False)
    dcp.save(adapter.to_hf(model.state_dict()), storage_writer=writer, no_dist=True)
    consolidate_safetensors_files_on_every_rank(str(step / "sharded"), str(step), adapter.fqn_to_index_mapping)
    finish_hf_export(args, str(tmp_path / "out"), "")
    saved, exported = folder_tensors(hub), folder_tensors(step)
    assert sorted(saved) == sorted(exported)
    assert all(torch.equal(saved[key], exported[key]) for key in saved)
    _, info = AutoModelForCausalLM.from_pretrained(step, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_a_box_of_stacked_experts_reads_only_its_experts(tmp_path, monkeypatch):
    write_hub_folder(TINY_QWEN3_MOE, tmp_path)
    plan = hub_layout.import_plan(meta_model(model_args(TINY_QWEN3_MOE)), str(tmp_path))
    key = "model.layers.1.mlp.experts.gate_up_proj"  # [8 experts, gate; up, hidden]
    whole = hub_layout.converted_box(plan, key, (0, 0, 0), (8, 64, 64))
    read = []
    original = hub_layout._read_slice
    monkeypatch.setattr(hub_layout, "_read_slice", lambda plan, hub_key, cut: read.append(hub_key) or original(plan, hub_key, cut))
    box = hub_layout.converted_box(plan, key, (4, 16, 8), (2, 32, 40))  # an EP rank's experts, a TP rank's rows
    assert torch.equal(box, whole[4:6, 16:48, 8:48])
    assert sorted(read) == sorted(f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in (4, 5) for p in ("gate", "up"))


def test_a_folder_lacking_an_expert_stops_before_the_load(tmp_path):
    from titan_ext.host.preflight import _check_hub_tensors

    write_hub_folder(TINY_QWEN3_MOE, tmp_path)
    model = meta_model(model_args(TINY_QWEN3_MOE))
    _check_hub_tensors(model, str(tmp_path), "--checkpoint.initial_load_path")  # as saved: passes
    index = json.loads((tmp_path / hub_layout.INDEX).read_text())["weight_map"]
    dropped = "model.layers.0.mlp.experts.3.down_proj.weight"
    shard = tmp_path / index[dropped]
    save_file({k: v for k, v in load_file(shard).items() if k != dropped}, shard, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="down_proj' of shape \\[7, 64, 32\\], this model needs \\[8, 64, 32\\]"):
        _check_hub_tensors(model, str(tmp_path), "--checkpoint.initial_load_path")
    for name in os.listdir(tmp_path):
        if name.endswith(".safetensors"):
            save_file({k: v for k, v in load_file(tmp_path / name).items() if "experts" not in k}, tmp_path / name)
    with pytest.raises(ConfigError, match="holds nothing Qwen3MoeForTitan's 'model.layers.0.mlp.experts.gate_up_proj'"):
        _check_hub_tensors(model, str(tmp_path), "--checkpoint.initial_load_path")


def test_a_quantized_hub_folder_is_refused_in_one_line_and_never_exported_as_quantized(tmp_path):
    """DeepSeek-V3's and gpt-oss's hub weights are quantized (fp8 blocks, mxfp4): their values are codes, not
    weights; the config key that says so describes storage, not the architecture an export writes."""
    import json

    from titan_ext.errors import ConfigError
    from titan_ext.host.preflight import _check_not_quantized
    from titan_ext.models.args import architecture_fields

    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "quantization_config": fp8}))
    with pytest.raises(ConfigError) as error:
        _check_not_quantized(str(tmp_path), "--checkpoint.initial_load_path")
    assert "quantized weights (config.json's quantization_config: fp8)" in str(error.value)
    assert "\n" not in str(error.value)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    _check_not_quantized(str(tmp_path), "--checkpoint.initial_load_path")  # full precision: no word
    from transformers import DeepseekV3Config

    assert "quantization_config" not in architecture_fields(DeepseekV3Config, {"quantization_config": fp8})
