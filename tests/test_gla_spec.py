"""The fla_gla train spec, model adapter, CPU mode, data and FSDP wiring, in one process."""

import json
import math
import os

import pytest
import torch
import titan_ext  # noqa: F401  (registers specs, installs CPU mode)
from torchtitan.config import ConfigManager
from torchtitan.protocols.train_spec import get_train_spec

from titan_ext.models.gla import GLA_CHUNK_SIZE, GLAForTitan, GLAModelArgs, gla_flavors

CONFIG = os.path.join(os.path.dirname(__file__), "..", "train_configs", "debug_gla.toml")


def job_config(*args):
    return ConfigManager().parse_args(["--job.config_file", CONFIG, *args])


def test_spec_registered_with_flavors():
    spec = get_train_spec("fla_gla")
    assert set(spec.model_args) == {"debugmodel", "340M", "1.3B", "7B"}
    assert spec.model_cls is GLAForTitan
    args = spec.model_args["340M"]
    assert (args.hidden_size, args.num_hidden_layers, args.num_heads) == (1024, 24, 4)
    assert (args.expand_k, args.expand_v, args.hidden_ratio, args.vocab_size) == (0.5, 1.0, 4, 32000)


def test_340M_matches_public_parameter_count():
    with torch.device("meta"):
        model = GLAForTitan(gla_flavors["340M"])
    nparams, _ = gla_flavors["340M"].get_nparams_and_flops(model, 2048)
    assert nparams == 374_475_776  # fla-hub/gla-340M, flame's gla_340M config


def build_debug(**overrides):
    args = GLAModelArgs(**{**gla_flavors["debugmodel"].architecture(), **overrides})
    with torch.device("meta"):
        model = GLAForTitan(args)
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


def test_flops_are_linear_attention_flops():
    args = gla_flavors["340M"]
    with torch.device("meta"):
        model = GLAForTitan(args)
    nparams, flops = args.get_nparams_and_flops(model, 2048)
    embedding = args.vocab_size * args.hidden_size
    key_dim, value_dim = 512, 1024
    mixer = 3 * 24 * (2 * GLA_CHUNK_SIZE * (key_dim + value_dim) + 4 * key_dim * value_dim // 4)
    assert flops == 6 * (nparams - embedding) + mixer
    # No softmax-attention term: the cost per token does not grow with the sequence.
    assert args.get_nparams_and_flops(model, 8192)[1] == flops


def test_hf_config_overrides_flavor(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gla", "hidden_size": 96, "num_heads": 2, "architectures": ["x"]}))
    args = GLAModelArgs(**gla_flavors["debugmodel"].architecture())
    args.update_from_config(job_config("--titan_ext.hf_config", str(path)))
    assert (args.hidden_size, args.num_heads, args.num_hidden_layers) == (96, 2, 2)


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "no such file"),
        ("{not json", "is not valid JSON"),
        ('{"model_type": "llama"}', "does not match this train spec's 'gla'"),
    ],
)
def test_hf_config_errors_are_one_line(tmp_path, content, message):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    args = GLAModelArgs()
    with pytest.raises(ValueError, match=message) as err:
        args.update_from_config(job_config("--titan_ext.hf_config", str(path)))
    assert "--titan_ext.hf_config" in str(err.value) and "\n" not in str(err.value)


def test_cpu_mode_rebinds_torchtitan_device():
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools_utils

    assert not torch.accelerator.is_available()
    for module in (tools_utils, dist_utils, metrics, parallel_dims):
        assert module.device_type == "cpu", module.__name__
    device_module = tools_utils.device_module
    assert isinstance(device_module.current_device(), int)
    assert device_module.memory_stats()["reserved_bytes.all.peak"] > 0
    monitor = metrics.build_device_memory_monitor()
    assert monitor.get_peak_stats().max_reserved_gib > 0


def test_shipped_tokenizer_and_corpus_load_from_any_directory(tmp_path, monkeypatch):
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    from titan_ext.data import TINY_DATASET, build_tokenizer

    monkeypatch.chdir(tmp_path)
    tokenizer = build_tokenizer(job_config())
    assert tokenizer.get_vocab_size() <= gla_flavors["debugmodel"].vocab_size
    ids = tokenizer.encode("The fox found a map near the river.", add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    dataset = HuggingFaceTextDataset(TINY_DATASET, None, tokenizer, seq_len=64)
    inputs, labels = next(iter(dataset))
    assert inputs["input"].shape == (64,) and torch.equal(inputs["input"][1:], labels[:-1])


def test_missing_assets_and_dataset_fail_clearly(tmp_path):
    from titan_ext.data import build_tokenizer, load_jsonl_text

    with pytest.raises(ValueError, match="--model.hf_assets_path='nowhere'"):
        build_tokenizer(job_config("--model.hf_assets_path", "nowhere"))
    with pytest.raises(ValueError, match="--training.dataset_path="):
        load_jsonl_text(str(tmp_path / "missing.jsonl"))


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{29500 + os.getpid() % 1000}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("policy,blocks_reshard,head_reshard", [("default", True, False), ("always", True, True), ("never", False, False)])
def test_apply_fsdp_groups_policies_and_precision(one_rank_group, policy, blocks_reshard, head_reshard):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from titan_ext.parallelize import apply_fsdp

    model = build_debug()
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    apply_fsdp(model, mesh, torch.bfloat16, torch.float32, cpu_offload=True, reshard_after_forward_policy=policy)

    def state(module):
        assert isinstance(module, FSDPModule), type(module)
        return module._get_fsdp_state()

    assert isinstance(model, FSDPModule)
    for module in [model.model.embeddings, *model.model.layers, model.model.norm]:
        group = state(module)._fsdp_param_group
        assert group.mp_policy.param_dtype == torch.bfloat16 and group.mp_policy.reduce_dtype == torch.float32
        assert isinstance(group.offload_policy, CPUOffloadPolicy)
        # Gradients are summed (the loss is already normalized), by plain SUM on gloo.
        assert group.gradient_divide_factor == 1.0 and group.force_sum_reduction_for_comms
    for block in model.model.layers:
        assert (state(block)._fsdp_param_group.post_forward_mesh_info is not None) == blocks_reshard
    head_group = state(model.model.norm)._fsdp_param_group
    assert any(p.sharded_param is model.lm_head.weight for p in head_group.fsdp_params)
    assert (head_group.post_forward_mesh_info is not None) == head_reshard


def test_unknown_reshard_policy_is_rejected():
    from titan_ext.parallelize import _reshard_after_forward

    with pytest.raises(ValueError, match="fsdp_reshard_after_forward='sometimes'"):
        _reshard_after_forward("sometimes", False)


def test_cpu_mode_changes_nothing_when_an_accelerator_exists(monkeypatch):
    import torchtitan.tools.utils as tools_utils

    import titan_ext.cpu_mode as cpu_mode

    monkeypatch.setattr(cpu_mode, "has_accelerator", lambda: True)
    monkeypatch.setattr(tools_utils, "device_type", "cuda")
    monkeypatch.setattr(tools_utils, "device_module", torch.cuda)
    assert cpu_mode.enable_cpu_mode() is False
    assert tools_utils.device_type == "cuda" and tools_utils.device_module is torch.cuda
