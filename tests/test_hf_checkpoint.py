"""HF checkpoints in and out of a sharded torchtitan job, for every train spec (CPU, gloo, FSDP=2).

torchtitan saves only at the end of a step, so a "0-step" round trip is one
step at learning rate 0 (AdamW's update, decay included, is then exactly 0).
"""

import json

import pytest
import torch
from launch import torchrun
from safetensors.torch import load_file

import titan_ext  # noqa: F401  (portable kernels, train specs)
from titan_ext.checkpoint import HFStateDictAdapter, check_hf_config
from titan_ext.models import sdpa_attention
from titan_ext.train_specs import TRAIN_SPECS
from transformers import AutoModelForCausalLM

sdpa_attention.install()  # fla's Transformer builds without flash-attn

SPECS = {
    "fla_gla": "debug_gla.toml",
    "hf_llama": "debug_llama.toml",
    "fla_transformer": "debug_transformer.toml",
}


def debug_hf_config(spec: str, **changes):
    args = TRAIN_SPECS[spec]().model_args["debugmodel"]
    config = HFStateDictAdapter(args, None).hf_config()
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def save_random_model(spec: str, directory, **changes) -> torch.nn.Module:
    """An HF model with random weights everywhere (norms too), saved with ``save_pretrained``."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(debug_hf_config(spec, **changes))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(directory)
    return model.eval()


def safetensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def hf_round_trip(spec, tmp_path, source, nproc=2):
    return torchrun(
        SPECS[spec], tmp_path / "job", "--parallelism.data_parallel_shard_degree", str(nproc),
        "--checkpoint.enable", "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(source),
        "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only", "--checkpoint.export_dtype", "float32",
        "--training.steps", "1", "--optimizer.lr", "0",
        nproc=nproc,
    )


@pytest.mark.parametrize("spec", list(SPECS))
def test_hf_round_trip_is_exact(spec, tmp_path):
    source = tmp_path / "hf_in"
    original = save_random_model(spec, source)
    run = hf_round_trip(spec, tmp_path, source).check()
    out = tmp_path / "job" / "checkpoint" / "step-1"
    assert (out / "config.json").is_file(), f"no config.json in {sorted(p.name for p in out.iterdir())}"

    before, after = safetensors(source), safetensors(out)
    assert sorted(after) == sorted(before), run.output[-3000:]
    for key, tensor in before.items():
        assert after[key].dtype == tensor.dtype and torch.equal(after[key], tensor), f"{spec}: {key} changed"

    reloaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert json.loads((out / "config.json").read_text())["model_type"] == original.config.model_type
    tokens = torch.randint(0, original.config.vocab_size, (2, 32))
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(tokens).logits, original(tokens).logits)


def test_mismatched_config_fails_the_job_clearly(tmp_path):
    source = tmp_path / "hf_in"
    save_random_model("hf_llama", source, hidden_size=128)
    run = hf_round_trip("hf_llama", tmp_path, source, nproc=1)
    assert run.returncode != 0
    assert "config.json does not match --model.flavor: hidden_size=64 (flavor) vs 128 (checkpoint)" in run.output, run.output[-3000:]


@pytest.mark.parametrize("spec", list(SPECS))
def test_config_check_names_each_differing_field(spec, tmp_path):
    config = debug_hf_config(spec)
    config.num_hidden_layers += 1
    config.vocab_size *= 2
    config.save_pretrained(tmp_path)
    args = TRAIN_SPECS[spec]().model_args["debugmodel"]
    with pytest.raises(ValueError) as error:
        check_hf_config(args, str(tmp_path))
    message = str(error.value)
    assert "num_hidden_layers=2 (flavor) vs 3 (checkpoint)" in message and "vocab_size=2048 (flavor) vs 4096" in message
    assert "hidden_size" not in message, message
    debug_hf_config(spec).save_pretrained(tmp_path)
    check_hf_config(args, str(tmp_path))  # a matching directory passes
