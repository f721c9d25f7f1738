"""Activation checkpointing and per-block compile: in-process on a 4-block GLA, plus two shared launches."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from launch import assert_close, torchrun
from torch._dynamo.utils import counters
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torchtitan.config.job_config import ActivationCheckpoint, Compile
from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list

import titan_ext  # noqa: F401  (portable kernels)
from titan_ext import activation_checkpoint
from titan_ext.activation_checkpoint import apply_ac
from titan_ext.compile import apply_compile
from titan_ext.kernels import gla_op
from titan_ext.models.gla import GLAForTitan, gla_flavors

CONFIG = "debug_gla.toml"
SEED = ("--debug.seed", "0", "--training.max_norm", "1e9", "--training.steps", "4")


def job(mode="none", option="2", compile_enable=False, components=("model", "loss"), backend="aot_eager"):
    return SimpleNamespace(
        activation_checkpoint=ActivationCheckpoint(mode=mode, selective_ac_option=option),
        compile=Compile(enable=compile_enable, components=list(components), backend=backend),
        job=SimpleNamespace(dump_folder="/tmp"),
    )


@pytest.fixture(scope="module")
def base_model():
    args = copy.deepcopy(gla_flavors["debugmodel"])
    args.num_hidden_layers = 4
    torch.manual_seed(0)
    model = GLAForTitan(args)
    model.init_weights()
    return model


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 2048, (2, 128), generator=torch.Generator().manual_seed(1))


def loss_and_grads(model, tokens):
    model.zero_grad()
    loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "mode, option, error",
    [
        ("fullish", "2", "--activation_checkpoint.mode='fullish' is invalid; use one of none, full, selective"),
        ("selective", "0", "--activation_checkpoint.selective_ac_option='0' is invalid; use 'op' or a positive"),
        ("selective", "ops", "--activation_checkpoint.selective_ac_option='ops' is invalid"),
        ("memory_budget", "2", "--activation_checkpoint.mode=memory_budget works only with a compiled model"),
    ],
)
def test_bad_ac_config_is_one_line_error(base_model, mode, option, error):
    model = copy.deepcopy(base_model)
    with pytest.raises(ValueError) as info:
        apply_ac(model, job(mode, option))
    assert str(info.value).startswith(error) and "\n" not in str(info.value)
    assert not any(isinstance(m, CheckpointWrapper) for m in model.modules()), "error must come before wrapping"


def test_unknown_compile_component_is_an_error(base_model):
    with pytest.raises(ValueError, match=r"--compile.components has unknown entries \['modle'\]"):
        apply_compile(copy.deepcopy(base_model), Compile(enable=True, components=["modle"]))


@pytest.mark.parametrize(
    "mode, option, wrapped",
    [("full", "2", [0, 1, 2, 3]), ("selective", "1", [0, 1, 2, 3]), ("selective", "2", [1, 3]),
     ("selective", "3", [2]), ("selective", "op", [0, 1, 2, 3])],
)
def test_ac_modes_wrap_blocks_and_match_no_ac(base_model, tokens, mode, option, wrapped):
    ref_loss, ref_grads = loss_and_grads(base_model, tokens)
    model = copy.deepcopy(base_model)
    apply_ac(model, job(mode, option))
    layers = model.model.layers
    assert [i for i, b in enumerate(layers) if isinstance(b, CheckpointWrapper)] == wrapped
    loss, grads = loss_and_grads(model, tokens)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("save_list", ["titan_ext", "torchtitan"])
def test_op_sac_saves_the_gla_core_and_every_other_mm(base_model, tokens, monkeypatch, save_list):
    """Count, per op, what backward's recompute replays from the cache and what it runs again.

    torch 2.13 calls the policy only in forward (the recompute mode ignores
    ``ctx.is_recompute`` and replays forward's decisions), so the count hooks
    the recompute mode itself. With torchtitan's own save list (the control)
    the GLA core runs twice per block; with titan_ext's, once.
    """
    replayed = []
    cached_mode = torch_checkpoint._CachedTorchDispatchMode
    original = cached_mode.__torch_dispatch__

    def recording(self, func, types, args=(), kwargs=None):
        if func not in torch_checkpoint.SAC_IGNORED_OPS:
            key = torch_checkpoint._sac_storage_key(func, args)
            entry = self.storage.get(key, {}).get(self.func_counter[key])
            replayed.append((func, entry is torch_checkpoint._RECOMPUTE))
        return original(self, func, types, args, kwargs)

    gla_runs = []
    portable_forward = gla_op._portable_forward
    monkeypatch.setattr(gla_op, "_portable_forward", lambda *a: gla_runs.append(1) or portable_forward(*a))
    monkeypatch.setattr(cached_mode, "__torch_dispatch__", recording)
    if save_list == "torchtitan":
        monkeypatch.setattr(activation_checkpoint, "OP_SAC_SAVE_LIST", _op_sac_save_list)
    model = copy.deepcopy(base_model)
    apply_ac(model, job("selective", "op"))
    loss_and_grads(model, tokens)

    def count(func, recomputed):
        return sum(1 for f, r in replayed if f == func and r == recomputed)

    mm, gla_fwd = torch.ops.aten.mm.default, torch.ops.titan_ext.chunk_gla_fwd.default
    # 4 blocks x 9 bias-free projections (q, k, v, gk.0, g, o, gate, up, down; gk.1 is an addmm):
    # the cache serves every other one, the rest run again
    assert (count(mm, False), count(mm, True)) == (20, 16)
    # the GLA core is one op to SAC: none of its inner work (cumsum, batched matmuls) is seen
    assert count(torch.ops.aten.cumsum.default, True) + count(torch.ops.aten.bmm.default, True) == 0
    if save_list == "titan_ext":
        assert (count(gla_fwd, False), count(gla_fwd, True)) == (4, 0)
        assert len(gla_runs) == 4, "each block's GLA core must run once (forward only)"
    else:
        assert (count(gla_fwd, False), count(gla_fwd, True)) == (0, 4)
        assert len(gla_runs) == 8


def run_compiled(model, tokens, backend="aot_eager"):
    torch._dynamo.reset()
    counters.clear()
    apply_compile(model, Compile(enable=True, components=["model"], backend=backend))
    with torch._dynamo.config.patch(error_on_recompile=True):
        loss, grads = loss_and_grads(model, tokens)
        loss_and_grads(model, tokens)
    return loss, grads


def test_compile_one_frame_for_all_blocks(base_model, tokens):
    ref_loss, _ = loss_and_grads(base_model, tokens)
    model = copy.deepcopy(base_model)
    loss, _ = run_compiled(model, tokens)  # error_on_recompile: block 2..4 must reuse block 1's code
    assert counters["frames"]["ok"] == 1 and counters["stats"]["unique_graphs"] == 1, dict(counters["frames"])
    assert counters["aot_autograd"]["ok"] == 1
    assert all(type(b).__name__ == "OptimizedModule" for b in model.model.layers)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)


def test_compile_with_cuda_style_graph_break_still_shares_frames(base_model, tokens, monkeypatch):
    """A graph break inside every block (fla's own chunk_gla is torch.compiler.disable'd) costs no recompiles."""
    import fla.layers.gla as fla_gla

    monkeypatch.setattr(fla_gla, "chunk_gla", torch.compiler.disable(fla_gla.chunk_gla))
    model = copy.deepcopy(base_model)
    run_compiled(model, tokens)
    assert sum(counters["graph_break"].values()) > 0, "the simulated graph break did not happen"
    # error_on_recompile held: blocks 2..4 reused every frame (block, attn, resumes) that block 1 compiled
    assert counters["frames"]["ok"] > 0 and counters["frames"]["ok"] == counters["frames"]["total"]


def test_compile_with_ac_op_in_process(base_model, tokens):
    ref_loss, ref_grads = loss_and_grads(base_model, tokens)
    model = copy.deepcopy(base_model)
    apply_ac(model, job("selective", "op", compile_enable=True))
    loss, grads = run_compiled(model, tokens)
    assert counters["frames"]["ok"] == 1
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


# ---- end to end through torchrun: one eager run, one AC-op + compiled run, same seed ----


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory):
    return torchrun(CONFIG, tmp_path_factory.mktemp("eager"), *SEED).check()


@pytest.fixture(scope="module")
def ac_compile_run(tmp_path_factory):
    return torchrun(
        CONFIG, tmp_path_factory.mktemp("ac_compile"), *SEED,
        "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op",
        "--compile.enable", "--compile.backend", "aot_eager",
        env={"TORCH_LOGS": "recompiles,graph_breaks"},
    ).check()


def test_e2e_ac_op_and_compile_match_eager(eager_run, ac_compile_run):
    assert "Applied selective (op) activation checkpointing to 2 blocks" in ac_compile_run.output
    assert "Compiled each of 2 blocks" in ac_compile_run.output
    assert "Compiling the loss function" in ac_compile_run.output
    assert "Recompiling function" not in ac_compile_run.output, ac_compile_run.output[-4000:]
    assert_close(ac_compile_run.losses, eager_run.losses, 1e-5, "loss, AC op + compile vs eager")
