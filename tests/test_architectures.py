"""The fla Transformer and HF Llama train specs: meta-device init, FLOPs, and training end to end (CPU, FSDP=2)."""

import copy

import pytest
import torch
from launch import CONFIGS, torchrun

import titan_ext  # noqa: F401  (portable kernels, train specs)
from titan_ext.train_specs import TRAIN_SPECS

DEBUG_SPECS = ["fla_gla", "fla_transformer", "hf_llama"]


def debug_model(spec: str, device: str) -> torch.nn.Module:
    train_spec = TRAIN_SPECS[spec]()
    with torch.device(device):
        return train_spec.model_cls(train_spec.model_args["debugmodel"])


@pytest.mark.parametrize("spec", DEBUG_SPECS)
def test_meta_init_leaves_no_garbage(spec):
    model = debug_model(spec, "meta")
    model.to_empty(device="cpu")
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.no_grad():
        for tensor in tensors.values():
            tensor.fill_(float("nan"))
    model.init_weights()
    assert [name for name, t in tensors.items() if t.isnan().any()] == []
    fresh = dict(debug_model(spec, "cpu").named_buffers())
    for name, buffer in model.named_buffers():
        if name.endswith("inv_freq"):
            assert torch.equal(buffer, fresh[name]), f"{spec}: {name} differs from a freshly built model's"
    logits = model(torch.randint(0, 2048, (2, 16)))
    assert logits.shape == (2, 16, 2048) and logits.isfinite().all()


def test_llama_has_rotary_buffers_to_check():
    assert any(name.endswith("rotary_emb.inv_freq") for name, _ in debug_model("hf_llama", "meta").named_buffers())


@pytest.mark.parametrize(
    "spec,flavor,billions",
    [("hf_llama", "1B", 1.236), ("hf_llama", "3B", 3.213), ("hf_llama", "8B", 8.030), ("fla_transformer", "340M", 0.374)],
)
def test_flavor_sizes(spec, flavor, billions):
    train_spec = TRAIN_SPECS[spec]()
    args = train_spec.model_args[flavor]
    with torch.device("meta"):
        model = train_spec.model_cls(args)
    nparams, _ = args.get_nparams_and_flops(model, 2048)
    assert round(nparams / 1e9, 3) == billions


def test_attention_flops_term():
    llama = TRAIN_SPECS["hf_llama"]().model_args["8B"]
    assert llama.mixer_flops_per_token(4096) == 12 * 32 * 32 * 128 * 4096
    transformer = TRAIN_SPECS["fla_transformer"]().model_args["340M"]
    assert transformer.mixer_flops_per_token(2048) == 12 * 24 * 1024 * 2048


@pytest.mark.parametrize("config", ["debug_transformer.toml", "debug_llama.toml"])
def test_trains_with_fsdp2(config, tmp_path):
    run = torchrun(config, tmp_path, "--parallelism.data_parallel_shard_degree", "2", nproc=2).check()
    assert len(run.losses) == 10, run.output[-3000:]
    assert run.losses[-1] < run.losses[0] - 0.5, f"{config}: loss did not fall: {run.losses}"
    assert "Applied FSDP" in run.output


def test_hf_config_in_older_spelling_reaches_the_model(tmp_path):
    """A hub Llama config.json spells RoPE as rope_theta/rope_scaling; the flavor must pick it up."""
    import json

    from torchtitan.config import ConfigManager

    from titan_ext.models.llama import llama_flavors

    path = tmp_path / "config.json"
    scaling = {"factor": 16.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 128, "rope_type": "llama3"}
    path.write_text(json.dumps({"model_type": "llama", "rope_theta": 250000.0, "rope_scaling": scaling}))
    args = copy.deepcopy(llama_flavors["debugmodel"])
    args.update_from_config(ConfigManager().parse_args([
        "--job.config_file", str(CONFIGS / "debug_llama.toml"), "--titan_ext.hf_config", str(path),
    ]))
    assert args.rope_parameters["rope_theta"] == 250000.0 and args.rope_parameters["factor"] == 16.0
    assert args.hidden_size == 64  # fields the file does not give keep the flavor's value
