"""The fla GLA/Transformer and HF Llama train specs: meta-device init, sizes, FLOPs, HF config overrides."""

import copy

import pytest
import torch
from helpers import REPO, job_config

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


def test_attention_flops_grow_with_keys_and_stop_at_the_window():
    llama = TRAIN_SPECS["hf_llama"]().model_args["8B"]
    assert llama.mixer_flops_per_token(4096) == 2 * llama.mixer_flops_per_token(2048) > 0
    transformer = TRAIN_SPECS["fla_transformer"]().model_args["340M"]
    assert transformer.mixer_flops_per_token(2048) == 2 * transformer.mixer_flops_per_token(1024) > 0
    transformer.window_size = 512
    assert transformer.mixer_flops_per_token(8192) == transformer.mixer_flops_per_token(512)
    assert transformer.mixer_flops_per_token(256) < transformer.mixer_flops_per_token(512)


def test_llama_debug_flops_by_hand():
    """debugmodel: vocab 2048, hidden 64, MLP 128, 2 layers, 4 heads (head dim 16), 2 KV heads, tied head.

    Parameters: embedding 2048 * 64 = 131072 (shared with lm_head); per layer q 4096 + k 2048 + v 2048
    + o 4096 + gate/up/down 3 * 8192 + 2 norms 128 = 36992; final norm 64. Total 205120, all matmul
    weights (the tied embedding is the head). Attention at seq_len 128: 12 * 2 * 4 * 16 * 128 = 196608.
    """
    spec = TRAIN_SPECS["hf_llama"]()
    args = spec.model_args["debugmodel"]
    with torch.device("meta"):
        model = spec.model_cls(args)
    assert args.get_nparams_and_flops(model, 128) == (205_120, 6 * 205_120 + 196_608)


def test_hf_config_in_older_spelling_reaches_the_model(tmp_path, monkeypatch):
    """A hub Llama config.json spells RoPE as rope_theta/rope_scaling; the flavor must pick it up."""
    import json

    from titan_ext.models.llama import llama_flavors

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = tmp_path / "config.json"
    scaling = {"factor": 16.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 128, "rope_type": "llama3"}
    path.write_text(json.dumps({"model_type": "llama", "rope_theta": 250000.0, "rope_scaling": scaling}))
    args = copy.deepcopy(llama_flavors["debugmodel"])
    args.update_from_config(job_config("--titan_ext.hf_config", str(path),
                                       config_file=REPO / "train_configs" / "debug_llama.toml"))
    assert args.rope_parameters["rope_theta"] == 250000.0 and args.rope_parameters["factor"] == 16.0
    assert args.hidden_size == 64  # fields the file does not give keep the flavor's value
