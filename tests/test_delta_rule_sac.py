"""Op-level selective AC on the delta-rule cores (fla_kda, fla_gated_deltanet; portable kernels, in process)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torchtitan.config.job_config import ActivationCheckpoint

from titan_ext import activation_checkpoint, compat
from titan_ext.activation_checkpoint import ac_choice, apply_ac
from titan_ext.kernels import delta_rule_op
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
    """Gradients as without AC, and the core's forward runs once per block in backward: inside its own
    backward op (autograd through the portable core), not again in SAC's recompute, which replays the op's
    saved output. With torchtitan's save list (the control) the recompute runs the core a second time."""
    torch.manual_seed(0)
    model = build_model(copy.deepcopy(MODELS[rule]))
    model.init_weights()
    tokens = torch.randint(0, 2048, (1, 40), generator=torch.Generator().manual_seed(1))  # KDA: 3 chunks, a ragged end
    reference = loss_and_grads(model, tokens)

    runs = []
    core = delta_rule_op._RULES[rule]
    monkeypatch.setitem(delta_rule_op._RULES, rule, lambda *a: runs.append(1) or core(*a))
    if save_list == "torchtitan":
        monkeypatch.setattr(activation_checkpoint, "op_sac_save_list", lambda: compat.torchtitan_ac().op_sac_save_list)
    apply_ac(model, ac_choice(SimpleNamespace(activation_checkpoint=ActivationCheckpoint(
        mode="selective", selective_ac_option="op"))))
    model.zero_grad()
    loss = model(tokens).float().logsumexp(-1).mean()
    blocks = len(model.model.layers)
    assert len(runs) == blocks
    loss.backward()
    assert len(runs) - blocks == (blocks if save_list == "titan_ext" else 2 * blocks), "core runs in backward"
    for grad, ref in zip([p.grad for p in model.parameters()], reference):
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-7)
