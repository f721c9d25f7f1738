"""The fla_gla train spec, model adapter, CPU mode, data and FSDP wiring, in one process."""

import json

import pytest
import torch
from helpers import job_config
from torchtitan.protocols.train_spec import get_train_spec

import titan_ext  # noqa: F401  (registers the train specs and the shipped dataset)
from titan_ext.errors import EXIT_CODE, ConfigError
from titan_ext.models.adapter import build_model
from titan_ext.models.args import load_hf_config_json
from titan_ext.models.gla import gla, gla_flavors


def test_spec_registered_with_flavors():
    spec = get_train_spec("fla_gla")
    assert set(spec.model_args) == {"debugmodel", "340M", "1.3B", "7B", "debugmodel_hybrid", "340M_hybrid"}
    assert spec.model_cls is build_model
    config = spec.model_args["340M"].to_hf_config()
    assert (config.hidden_size, config.num_hidden_layers, config.num_heads) == (1024, 24, 4)
    assert (config.expand_k, config.expand_v, config.hidden_ratio, config.vocab_size) == (0.5, 1.0, 4, 32000)
    assert spec.model_args["340M"] is not spec.model_args["340M"]  # a fresh copy per lookup


def test_build_model_makes_the_titan_class_with_portable_kernels():
    from fla.layers.gla import GatedLinearAttention

    with torch.device("meta"):
        model = build_model(gla_flavors["debugmodel"])
    assert type(model).__name__ == "GLAForTitan"
    attn = model.model.layers[0].attn
    assert isinstance(attn, GatedLinearAttention) and type(attn) is not GatedLinearAttention  # bound on CPU


def test_340M_matches_public_parameter_count():
    with torch.device("meta"):
        model = build_model(gla_flavors["340M"])
    nparams, _ = gla_flavors["340M"].get_nparams_and_flops(model, 2048)
    assert nparams == 374_475_776  # fla-hub/gla-340M, flame's gla_340M config


def build_debug(**overrides):
    args = gla(**{**gla_flavors["debugmodel"].architecture(), **overrides})
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cpu")
    return model


@pytest.mark.parametrize("fuse_norm", [True, False])
def test_init_weights_initializes_every_tensor(fuse_norm):
    model = build_debug(fuse_norm=fuse_norm)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.fill_(float("nan"))
        model.init_weights()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.isfinite(tensor).all(), f"{name} was not initialized"
    std = model.model.layers[0].attn.q_proj.weight.std().item()
    assert abs(std - model.config.initializer_range) < 0.005


def test_a_model_built_on_the_meta_device_runs_no_initializer_until_torchtitan_calls_one(monkeypatch):
    """HF's constructor initializes the weights (``post_init``); on the meta device there are none to set."""
    from fla.models.gla.modeling_gla import GLAPreTrainedModel

    # every HF model's initializer: the causal LM's and its base model's (each initializes what it holds, as
    # transformers has it; the classes titan_ext's kernels bind are subclasses)
    calls = []
    monkeypatch.setattr(GLAPreTrainedModel, "_init_weights", lambda self, module: calls.append((self, module)))
    with torch.device("meta"):
        model = build_model(gla_flavors["debugmodel"])
    assert calls == []
    model.to_empty(device="cpu")
    model.init_weights()  # as torchtitan does, once the tensors are real
    assert [module for _, module in calls] == list(model.modules())
    assert {type(owner).__name__ for owner, module in calls if module is model.model.layers[0]} == {"GLAModel"}


def test_forward_returns_logits_and_trains_on_cpu():
    model = build_debug()
    with torch.no_grad():
        model.init_weights()
    tokens = torch.randint(0, 2048, (2, 40))
    logits = model(tokens)
    assert logits.shape == (2, 40, 2048)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_gla_mixer_cost_per_token_stops_growing_at_fla_chunk():
    """Linear attention: beyond fla's largest chunk (64) the per-token mixer cost is flat."""
    args = gla_flavors["340M"]
    at_64 = args.mixer_flops_per_token(64)
    assert all(args.mixer_flops_per_token(n) == at_64 for n in (65, 128, 2048, 8192, 131072))
    assert args.mixer_flops_per_token(16) < args.mixer_flops_per_token(32) < at_64  # smaller chunks below 64


def test_gla_flops_of_the_debug_model_by_hand():
    """debugmodel: hidden 64, 2 layers, 4 heads, vocab 2048, key dim 32, value dim 64, MLP width 256.

    Parameters: embeddings and lm_head 2048 * 64 = 131072 each; final norm 64; per layer
    attn_norm 64 + q 2048 + k 2048 + v 4096 + g 4096 + gk (64*16 + 16*32 + 32) 1568 + o 4096
    + g_norm 16 + mlp_norm 64 + gate/up/down 3 * 64 * 256 = 67248. Total 396704.
    Mixer at seq_len 2048 (chunk 64), per layer forward 2*64*(32+64) + 4*32*64/4 = 14336;
    x3 for training, x2 layers = 86016. FLOPs = 6 * (396704 - 131072) + 86016.
    """
    with torch.device("meta"):
        model = build_model(gla_flavors["debugmodel"])
    nparams, flops = gla_flavors["debugmodel"].get_nparams_and_flops(model, 2048)
    assert nparams == 396_704
    assert flops == 1_679_808


def test_hf_config_overrides_flavor(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gla", "hidden_size": 96, "num_heads": 2, "architectures": ["x"]}))
    args = gla(**gla_flavors["debugmodel"].architecture())
    args.update_from_config(job_config("--titan_ext.hf_config", str(path)))
    config = args.to_hf_config()
    assert (config.hidden_size, config.num_heads, config.num_hidden_layers) == (96, 2, 2)
    assert "architectures" not in args.config  # hub bookkeeping is not architecture


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "no such file"),
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "holds no JSON object"),
        ('{"model_type": "llama"}', "does not match this flavor's 'gla'"),
    ],
)
def test_hf_config_errors_are_one_line(tmp_path, content, message):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    source = f"--titan_ext.hf_config={str(path)!r}"
    with pytest.raises(ConfigError, match=message) as err:
        gla().update_from_hf_config(load_hf_config_json(str(path)), source)
    assert "--titan_ext.hf_config" in str(err.value) and "\n" not in str(err.value)


def test_update_from_config_turns_a_config_error_into_exit_2(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama"}')
    with pytest.raises(SystemExit) as exit_info:
        gla().update_from_config(job_config("--titan_ext.hf_config", str(path)))
    assert exit_info.value.code == EXIT_CODE == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "does not match this flavor's 'gla'" in errors[0] and "\n" not in errors[0]


# ---- CPU mode ---------------------------------------------------------------------------------


@pytest.fixture
def no_nvidia_env(monkeypatch):
    import titan_ext.cpu_mode as cpu_mode

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv(cpu_mode.FORCE_ENV, raising=False)
    if torch.accelerator.is_available() or cpu_mode.nvidia_hint() is not None:
        pytest.skip("this machine has (or looks like it has) an accelerator")
    return cpu_mode


def test_cpu_mode_wanted_without_accelerator(no_nvidia_env):
    assert no_nvidia_env.nvidia_hint() is None
    assert no_nvidia_env.wanted() is True


def test_cuda_visible_devices_without_cuda_is_a_one_line_error(no_nvidia_env, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ConfigError) as err:
        no_nvidia_env.wanted()
    message = str(err.value)
    assert "CUDA_VISIBLE_DEVICES" in message and "TITAN_EXT_CPU" in message and "\n" not in message


def test_force_env_wins_over_an_accelerator(no_nvidia_env, monkeypatch):
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert no_nvidia_env.wanted() is False
    monkeypatch.setenv(no_nvidia_env.FORCE_ENV, "1")
    assert no_nvidia_env.wanted() is True


def test_apply_cpu_mode_rebinds_torchtitan_devices_and_undo_restores_them():
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools_utils
    from torch.distributed.fsdp import FSDPModule

    from titan_ext import patching
    from titan_ext.cpu_mode import CPU_DEVICE_MODULE
    from titan_ext.host import cpu_patches

    if patching.active():
        pytest.skip("host patches are already applied in this process")
    targets = [(tools_utils, "device_type"), (tools_utils, "device_module"), (tools_utils, "get_peak_flops"),
               (dist_utils, "device_type"), (dist_utils, "device_module"), (parallel_dims, "device_type"),
               (metrics, "device_type"), (metrics, "device_module")]
    originals = {(m.__name__, name): getattr(m, name) for m, name in targets}
    divide_factor = vars(FSDPModule)["set_gradient_divide_factor"]
    assert {p.target for p in cpu_patches.CPU_MODE} >= {f"{m}:{n}" for m, n in originals}

    cpu_patches.apply_cpu_mode()
    try:
        for module in (tools_utils, dist_utils, metrics, parallel_dims):
            assert module.device_type == "cpu", module.__name__
        for module in (tools_utils, dist_utils, metrics):
            assert module.device_module is CPU_DEVICE_MODULE, module.__name__
        assert vars(FSDPModule)["set_gradient_divide_factor"] is not divide_factor
        assert isinstance(CPU_DEVICE_MODULE.current_device(), int)
        assert CPU_DEVICE_MODULE.memory_stats()["reserved_bytes.all.peak"] > 0
        monitor = metrics.build_device_memory_monitor()
        assert monitor.get_peak_stats().max_reserved_gib > 0
    finally:
        patching.undo()
    assert not patching.active()
    for (module_name, name), original in originals.items():
        module = {m.__name__: m for m, _ in targets}[module_name]
        assert getattr(module, name) is original, f"{module_name}.{name} not restored"
    assert vars(FSDPModule)["set_gradient_divide_factor"] is divide_factor


# ---- data ---------------------------------------------------------------------------------------


def test_shipped_tokenizer_and_corpus_load_from_any_directory(tmp_path, monkeypatch):
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    from titan_ext.data import TINY_DATASET, build_tokenizer

    monkeypatch.chdir(tmp_path)
    config = job_config()
    tokenizer = build_tokenizer(config)
    assert config.model.hf_assets_path == "titan_ext/assets/tiny"  # resolved, not written back
    assert tokenizer.get_vocab_size() <= gla_flavors["debugmodel"].config["vocab_size"]
    ids = tokenizer.encode("The fox found a map near the river.", add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    dataset = HuggingFaceTextDataset(TINY_DATASET, None, tokenizer, seq_len=64)
    inputs, labels = next(iter(dataset))
    assert inputs["input"].shape == (64,) and torch.equal(inputs["input"][1:], labels[:-1])


def test_missing_assets_and_dataset_fail_clearly(tmp_path):
    from titan_ext.data import build_tokenizer, load_jsonl_text

    with pytest.raises(ConfigError, match="--model.hf_assets_path='nowhere'"):
        build_tokenizer(job_config("--model.hf_assets_path", "nowhere"))
    with pytest.raises(ConfigError, match="--training.dataset_path=.*no such file"):
        load_jsonl_text(str(tmp_path / "missing.jsonl"))


def test_jsonl_text_loads_records_and_names_a_bad_line(tmp_path):
    from titan_ext.data import load_jsonl_text

    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "a"}\n\n{"text": "b", "id": 2}\n')
    assert load_jsonl_text(str(good))["text"] == ["a", "b"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(ConfigError, match="line 2 has no 'text' field"):
        load_jsonl_text(str(bad))


# ---- FSDP -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy,blocks_reshard,head_reshard", [("default", True, False), ("always", True, True), ("never", False, False)]
)
def test_apply_fsdp_groups_policies_and_precision(gloo_group, monkeypatch, policy, blocks_reshard, head_reshard):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from titan_ext.host.job import _data_parallel
    from titan_ext.parallel.parallelize import apply_fsdp

    dp = _data_parallel(job_config(
        "--parallelism.fsdp_reshard_after_forward", policy, "--training.enable_cpu_offload",
        "--training.mixed_precision_param", "bfloat16", "--training.mixed_precision_reduce", "float32",
    ), world_size=1)
    assert (dp.param_dtype, dp.reduce_dtype, dp.cpu_offload) == (torch.bfloat16, torch.float32, True)
    assert (dp.reshard_blocks, dp.reshard_head) == (blocks_reshard, head_reshard)

    model = build_debug()
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    apply_fsdp(model, mesh, dp)

    def state(module):
        assert isinstance(module, FSDPModule), type(module)
        return module._get_fsdp_state()

    assert isinstance(model, FSDPModule)
    for module in [model.model.embeddings, *model.model.layers, model.model.norm]:
        group = state(module)._fsdp_param_group
        # per parameter: torch 2.15 resolves the policy for each one (its groups hold none)
        assert {(p.mp_policy.param_dtype, p.mp_policy.reduce_dtype) for p in group.fsdp_params} == {
            (torch.bfloat16, torch.float32)}
        assert isinstance(group.offload_policy, CPUOffloadPolicy)
        # Gradients are summed (the loss is already normalized), by plain SUM on gloo.
        assert group.gradient_divide_factor == 1.0 and group.force_sum_reduction_for_comms
    for block in model.model.layers:
        assert (state(block)._fsdp_param_group.post_forward_mesh_info is not None) == blocks_reshard
    head_group = state(model.model.norm)._fsdp_param_group
    assert any(p.sharded_param is model.lm_head.weight for p in head_group.fsdp_params)
    assert (head_group.post_forward_mesh_info is not None) == head_reshard


def test_default_reshard_policy_keeps_blocks_gathered_with_pipeline_parallel(monkeypatch):
    from titan_ext.host.job import _data_parallel

    config = job_config("--parallelism.fsdp_reshard_after_forward", "default")
    config.parallelism.pipeline_parallel_degree = 2
    dp = _data_parallel(config, world_size=2)  # a PP=2 job has (at least) 2 ranks
    assert (dp.reshard_blocks, dp.reshard_head) == (False, False)
