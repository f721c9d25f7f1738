"""Op-level selective AC on the delta-rule cores (fla_kda, fla_gated_deltanet; portable kernels, in process)."""

from __future__ import annotations

import copy
import traceback
from types import SimpleNamespace

import pytest
import torch
from torchtitan.config.job_config import ActivationCheckpoint

from titan_ext import compat
from titan_ext.parallel import activation_checkpoint
from titan_ext.parallel.activation_checkpoint import ac_choice, apply_ac
from titan_ext.kernels import delta_rule_op, kda  # noqa: F401 (kda registers its core)
from titan_ext.models.adapter import build_model
from titan_ext.models.gated_deltanet import gated_deltanet_flavors
from titan_ext.models.kda import kda_flavors

MODELS = {"kda": kda_flavors["debugmodel"], "gated_delta": gated_deltanet_flavors["debugmodel"]}
"""The core's rule name -> a 2-block model whose mixers run it."""


def loss_and_grads(model, tokens):
    model.zero_grad()
    loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("rule, save_list", [("kda", "titan_ext"), ("gated_delta", "titan_ext"), ("kda", "torchtitan")])
def test_op_sac_saves_the_delta_rule_core(rule, save_list, monkeypatch):
    """Gradients as without AC and without the op (plain autograd through the core), and the core's forward
    runs once per block in backward, inside its own backward op: SAC's recompute replays the op's saved
    output. With torchtitan's save list (the control) the recompute runs the core again."""
    torch.manual_seed(0)
    model = build_model(copy.deepcopy(MODELS[rule]))
    model.init_weights()
    tokens = torch.randint(0, 2048, (1, 40), generator=torch.Generator().manual_seed(1))  # KDA: 3 chunks, a ragged end
    with monkeypatch.context() as plain:
        plain.setattr(delta_rule_op, "delta_rule", delta_rule_op.run_rule)
        reference = loss_and_grads(model, tokens)

    runs = []  # per run of the core: inside delta_rule_bwd?
    core = delta_rule_op._RULES[rule]

    def counted(*args):
        runs.append(any(frame.name == "delta_rule_bwd" for frame in traceback.extract_stack()))
        return core(*args)

    monkeypatch.setitem(delta_rule_op._RULES, rule, counted)
    if save_list == "torchtitan":
        monkeypatch.setattr(activation_checkpoint, "op_sac_save_list", lambda: compat.torchtitan_ac().op_sac_save_list)
    apply_ac(model, ac_choice(SimpleNamespace(activation_checkpoint=ActivationCheckpoint(
        mode="selective", selective_ac_option="op"))))
    model.zero_grad()
    loss = model(tokens).float().logsumexp(-1).mean()
    blocks = len(model.model.layers)
    assert runs == [False] * blocks
    loss.backward()
    in_backward_op, in_recompute = runs[blocks:].count(True), runs[blocks:].count(False)
    assert (in_backward_op, in_recompute) == (blocks, 0 if save_list == "titan_ext" else blocks)
    for grad, ref in zip([p.grad for p in model.parameters()], reference):
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("state_v_first, cu_seqlens", [(False, None), (True, [0, 7, 20])])
def test_delta_rule_op_registration(state_v_first, cu_seqlens):
    """The op's fake (shapes and dtypes for compile) and autograd registration agree with its kernel: KDA's
    core with initial and final states, per packed sequence."""
    gen = torch.Generator().manual_seed(0)
    q, k, g = (torch.randn(1, 20, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    v, h0 = torch.randn(1, 20, 2, 4, generator=gen, dtype=torch.float64), torch.randn(2, 2, 8, 4, dtype=torch.float64)
    beta = torch.rand(1, 20, 2, generator=gen, dtype=torch.float64)
    h0 = (h0 if cu_seqlens else h0[:1]).transpose(-1, -2) if state_v_first else (h0 if cu_seqlens else h0[:1])
    inputs = [x.requires_grad_() for x in (q, k / k.norm(dim=-1, keepdim=True), v, -g.sigmoid(), beta, h0)]
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    args = (*inputs, True, state_v_first, cu, torch.float32, "kda")
    checks = torch.library.opcheck(torch.ops.titan_ext.delta_rule_fwd.default, args,
                                   test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    assert set(checks.values()) == {"SUCCESS"}, checks
