"""Activation checkpointing and per-block compile, in process on a 4-block GLA (portable kernels)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch._dynamo.utils import counters
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode
from torchtitan.config.job_config import ActivationCheckpoint

from titan_ext import compat
from titan_ext.errors import ConfigError
from titan_ext.kernels import gla_op
from titan_ext.models.adapter import build_model
from titan_ext.models.gla import gla_flavors
from titan_ext.parallel import activation_checkpoint
from titan_ext.parallel.activation_checkpoint import ac_choice, apply_ac, check_ac
from titan_ext.parallel.compile import apply_compile


def choice(mode="none", option="2"):
    """The job plan's AC choice for ``--activation_checkpoint.mode/selective_ac_option``."""
    return ac_choice(SimpleNamespace(activation_checkpoint=ActivationCheckpoint(mode=mode, selective_ac_option=option)))


@pytest.fixture(scope="module")
def base_model():
    args = copy.deepcopy(gla_flavors["debugmodel"])
    args.config["num_hidden_layers"] = 4
    torch.manual_seed(0)
    model = build_model(args)
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
def test_bad_ac_config_is_one_line_error(mode, option, error):
    with pytest.raises(ConfigError) as info:
        check_ac(ActivationCheckpoint(mode=mode, selective_ac_option=option), compile_enabled=False)
    assert str(info.value).startswith(error) and "\n" not in str(info.value)


def test_good_ac_configs_pass_the_check():
    check_ac(ActivationCheckpoint(mode="memory_budget"), compile_enabled=True)
    for mode, option in [("none", "x"), ("full", "x"), ("selective", "op"), ("selective", "3")]:
        check_ac(ActivationCheckpoint(mode=mode, selective_ac_option=option), compile_enabled=False)
    assert (choice("selective", "3").every, choice("selective", "op").every, choice("full").every) == (3, None, None)


@pytest.mark.parametrize(
    "mode, option, wrapped",
    [("full", "2", [0, 1, 2, 3]), ("selective", "1", [0, 1, 2, 3]), ("selective", "2", [1, 3]),
     ("selective", "3", [2]), ("selective", "op", [0, 1, 2, 3])],
)
def test_ac_modes_wrap_blocks_and_match_no_ac(base_model, tokens, mode, option, wrapped):
    ref_loss, ref_grads = loss_and_grads(base_model, tokens)
    model = copy.deepcopy(base_model)
    apply_ac(model, choice(mode, option))
    layers = model.model.layers
    assert [i for i, b in enumerate(layers) if isinstance(b, CheckpointWrapper)] == wrapped
    loss, grads = loss_and_grads(model, tokens)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


class _RanAgain(TorchDispatchMode):
    """Beneath SAC's recompute mode: did the op it was handed run (not come from the cache)?"""

    expecting, ran = None, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is self.expecting:
            self.ran = True
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("save_list", ["titan_ext", "torchtitan"])
def test_op_sac_saves_the_gla_core_and_every_other_mm(base_model, tokens, monkeypatch, save_list):
    """Count, per op, what backward's recompute replays from the cache and what it runs again.

    The count hooks the recompute mode and sees, from a mode beneath it,
    whether each op it was handed ran again: no reading of its cache, whose
    layout changed between torch 2.11 and 2.13. With torchtitan's own save
    list (the control) the GLA core runs twice per block; with titan_ext's, once.
    """
    replayed = []
    cached_mode = torch_checkpoint._CachedTorchDispatchMode
    original = cached_mode.__torch_dispatch__
    beneath = _RanAgain()

    def recording(self, func, types, args=(), kwargs=None):
        if func in torch_checkpoint.SAC_IGNORED_OPS:
            return original(self, func, types, args, kwargs)
        beneath.expecting, beneath.ran = func, False
        out = original(self, func, types, args, kwargs)
        replayed.append((func, beneath.ran))
        beneath.expecting = None
        return out

    gla_runs = []
    portable_forward = gla_op._portable_forward
    monkeypatch.setattr(gla_op, "_portable_forward", lambda *a: gla_runs.append(1) or portable_forward(*a))
    monkeypatch.setattr(cached_mode, "__torch_dispatch__", recording)
    if save_list == "torchtitan":
        monkeypatch.setattr(activation_checkpoint, "op_sac_save_list", lambda: compat.torchtitan_ac().op_sac_save_list)
    model = copy.deepcopy(base_model)
    apply_ac(model, choice("selective", "op"))
    with beneath:
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
    apply_compile(model, backend)
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
    model = copy.deepcopy(base_model)
    # what the bound GLA layers' forward sees as chunk_gla (a copy of fla's globals; fla is untouched)
    scope = type(model.model.layers[0].attn).forward.__globals__
    assert scope["chunk_gla"] is gla_op.portable_chunk_gla
    monkeypatch.setitem(scope, "chunk_gla", torch.compiler.disable(gla_op.portable_chunk_gla))
    run_compiled(model, tokens)
    assert sum(counters["graph_break"].values()) > 0, "the simulated graph break did not happen"
    # error_on_recompile held: blocks 2..4 reused every frame (block, attn, resumes) that block 1 compiled
    assert counters["frames"]["ok"] > 0 and counters["frames"]["ok"] == counters["frames"]["total"]


def test_compile_with_ac_op_in_process(base_model, tokens):
    ref_loss, ref_grads = loss_and_grads(base_model, tokens)
    model = copy.deepcopy(base_model)
    apply_ac(model, choice("selective", "op"))
    loss, grads = run_compiled(model, tokens)
    assert counters["frames"]["ok"] == 1
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def test_compiled_fla_transformer_blocks_have_no_graph_break():
    """fla's RotaryEmbedding checks ``is_inference()`` on its filled cache (untraceable): titan_ext's
    models skip that check under compile, so each block stays one graph. The cache is filled before the
    compiled blocks first run (``rotary.fill_caches``), so no recompile at step 2: one graph for all steps."""
    from titan_ext.models.adapter import build_model
    from titan_ext.models.transformer import transformer_flavors

    torch.manual_seed(0)
    model = build_model(copy.deepcopy(transformer_flavors["debugmodel"]))
    model.init_weights()
    ref_loss, _ = loss_and_grads(copy.deepcopy(model), tokens_for(model))  # the copy fills its own cache
    apply_compile(model, "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    for _ in range(3):
        loss, _ = loss_and_grads(model, tokens_for(model))
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # the cache filled before step 1
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)


def tokens_for(model):
    return torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))


def test_a_compiled_hybrid_traces_each_mixer_kind_once():
    """A GLA hybrid (attention at layers 1 and 3) compiled without AC: one frame per mixer kind, and blocks 3
    and 4 reuse them. transformers >= 5.24 wraps every layer class's ``forward`` in one shared wrapper (the
    frame dynamo keys on); copying the wrapper alone left both kinds on one inner ``forward``: a recompile."""
    torch.manual_seed(0)
    model = build_model(copy.deepcopy(gla_flavors["debugmodel_hybrid"]))
    model.init_weights()
    tokens = tokens_for(model)
    ref_loss, ref_grads = loss_and_grads(copy.deepcopy(model), tokens)
    apply_compile(model, "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):  # one step: the rotary cache fills in it
        loss, grads = loss_and_grads(model, tokens)
    assert counters["frames"]["ok"] == 2 and counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
