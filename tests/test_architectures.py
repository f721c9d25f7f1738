"""The train specs (named and generic ``fla``/``hf``): meta-device init, sizes, FLOPs, HF config overrides."""

import copy

import pytest
import torch
from helpers import REPO, job_config

from titan_ext.train_specs import TRAIN_SPECS

DEBUG_SPECS = ["fla_gla", "fla_gated_deltanet", "fla_kda", "fla_transformer", "hf_llama"]


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
    [("hf_llama", "1B", 1.236), ("hf_llama", "3B", 3.213), ("hf_llama", "8B", 8.030), ("fla_transformer", "340M", 0.374),
     ("fla_gated_deltanet", "340M", 0.512), ("fla_gated_deltanet", "1.3B", 1.387)],
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
    transformer.config["window_size"] = 512
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
    rope = args.config["rope_parameters"]
    assert rope["rope_theta"] == 250000.0 and rope["factor"] == 16.0
    assert args.config["hidden_size"] == 64  # fields the file does not give keep the flavor's value


def test_gated_deltanet_debug_flops_by_hand():
    """debugmodel: hidden 64, 2 layers, 4 heads of key dim 16 and value dim 32 (expand_v 2), chunk 64.

    Per head and token, forward: 4*64*16 + 2*64*(16 + 32) + 2*64*32 + 6*16*32 = 17408; x4 heads,
    x2 layers, x3 for training = 417792. The 6N term counts every parameter but the input embedding.
    """
    spec = TRAIN_SPECS["fla_gated_deltanet"]()
    args = spec.model_args["debugmodel"]
    with torch.device("meta"):
        model = spec.model_cls(args)
    nparams, flops = args.get_nparams_and_flops(model, 2048)
    assert flops == 6 * (nparams - 2048 * 64) + 417_792


def generic_args(spec: str, config: dict, tmp_path, flag: str = "--titan_ext.hf_config"):
    """A generic spec's model args after a job config points at ``config`` (a file, or a directory's config.json)."""
    import json

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    if flag == "--model.hf_assets_path":  # a model's folder, as downloaded: the job loads its tokenizer too
        import shutil

        shutil.copy(REPO / "titan_ext" / "assets" / "tiny" / "tokenizer.json", folder)
    args = TRAIN_SPECS[spec]().model_args["from_config"]
    where = str(folder / "config.json") if flag == "--titan_ext.hf_config" else str(folder)
    args.update_from_config(job_config("--model.name", spec, flag, where))
    return args


TINY_QWEN3 = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 2048}


def test_fla_spec_trains_any_fla_model_from_its_config(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = {"model_type": "gated_deltanet", "hidden_size": 64, "num_heads": 2, "head_dim": 16,
              "num_hidden_layers": 2, "vocab_size": 2048, "architectures": ["GatedDeltaNetForCausalLM"]}
    args = generic_args("fla", config, tmp_path)
    assert args.config == {k: v for k, v in config.items() if k != "architectures"}
    torch.manual_seed(0)
    model = TRAIN_SPECS["fla"]().model_cls(args)
    assert type(model).__name__ == "GatedDeltaNetForTitan"
    model.init_weights()
    logits = model(torch.randint(0, 2048, (2, 80)))  # past one chunk of 64
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())


def test_hf_spec_reads_the_hf_assets_config(tmp_path, monkeypatch):
    """Without [titan_ext] hf_config, a generic spec reads model.hf_assets_path's config.json (e.g. a hub download)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = generic_args("hf", TINY_QWEN3, tmp_path, flag="--model.hf_assets_path")
    with torch.device("meta"):
        model = TRAIN_SPECS["hf"]().model_cls(args)
    assert type(model).__name__ == "Qwen3ForTitan" and model.config._attn_implementation == "sdpa"
    nparams, flops = args.get_nparams_and_flops(model, 128)
    assert flops == 6 * (nparams - 2048 * 64) + 12 * 2 * 4 * 16 * 128  # softmax attention over 128 keys


def test_shortcut_flavors_are_the_named_specs_flavors():
    fla, hf = TRAIN_SPECS["fla"]().model_args, TRAIN_SPECS["hf"]().model_args
    assert fla["gated_deltanet-340M"] == TRAIN_SPECS["fla_gated_deltanet"]().model_args["340M"]
    assert hf["llama-8B"] == TRAIN_SPECS["hf_llama"]().model_args["8B"]
    assert not any(name.startswith("llama-") for name in fla) and not any(name.startswith("gla-") for name in hf)
    assert fla["debugmodel"].config == {}  # torchtitan's default flavor name: the architecture comes from a config


def test_a_config_subclass_inherits_its_parents_architecture():
    from fla.models import GLAConfig

    from titan_ext.models.architecture import architecture_of
    from titan_ext.models.gla import GLA

    class MyConfig(GLAConfig):
        model_type = "my_test_gla"

    assert isinstance(architecture_of(MyConfig), GLA)


def test_setting_an_unknown_field_is_an_error():
    args = TRAIN_SPECS["fla_gla"]().model_args["debugmodel"]
    with pytest.raises(AttributeError, match=r"set config\['num_heads'\]"):
        args.num_heads = 2


def test_a_config_subclass_without_init_is_one_line():
    """transformers 5 generates an __init__ for a config subclass without one, dropping fla's defaults."""
    from fla.models import GLAConfig, GLAForCausalLM
    from transformers import AutoConfig, AutoModelForCausalLM

    from titan_ext.errors import ConfigError
    from titan_ext.models.architecture import causal_lm_classes

    class NoInitConfig(GLAConfig):
        model_type = "test_no_init_gla"

    class NoInitForCausalLM(GLAForCausalLM):
        config_class = NoInitConfig

    AutoConfig.register(NoInitConfig.model_type, NoInitConfig, exist_ok=True)
    AutoModelForCausalLM.register(NoInitConfig, NoInitForCausalLM, exist_ok=True)
    with pytest.raises(ConfigError, match="drops GLAConfig's defaults") as error:
        causal_lm_classes("test_no_init_gla", "fla", "--titan_ext.hf_config")
    assert "def __init__(self, **kwargs)" in str(error.value) and "\n" not in str(error.value)
