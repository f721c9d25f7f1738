"""The chunked loss (``[titan_ext] loss = "chunked"``): equal to torchtitan's loss over the whole logits.

Unit level: ``titan_ext.kernels.linear_cross_entropy`` against ``F.cross_entropy(..., reduction="sum")``,
forward and gradients, with ignored labels and chunks that do not divide the tokens; on 2 forked gloo ranks
with the head's weight sharded on the vocabulary (unevenly), with and without sequence parallel. Model level:
an adapted model whose head runs in the job's loss equals the same model's logits through torchtitan's loss.
The end-to-end rows (FSDP2, TP2 with documents, PP2 with accumulation) are in ``tests/integration_matrix.py``
(``chunked_*``); the refusals are here.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import DEBUG_GLA_TOML, REPO, job_config, on_forked_ranks, plan_forward

from titan_ext.errors import ConfigError
from titan_ext.kernels.linear_cross_entropy import linear_cross_entropy_sum, tp_linear_cross_entropy_sum

DEBUG_LLAMA_TOML = REPO / "train_configs" / "debug_llama.toml"


def _reference(hidden, weight, labels):
    """torchtitan's loss over the head's logits."""
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum", ignore_index=-100)


def _inputs(batch=2, seq=13, dim=16, vocab=37, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, dim, generator=g).to(dtype)
    weight = torch.randn(vocab, dim, generator=g).to(dtype)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[0, :4] = -100  # a document's first tokens, say
    labels[1, -1] = -100
    return hidden, weight, labels


def _loss_and_grads(fn, hidden, weight, labels, cotangent=0.37):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(hidden, weight, labels)
    (loss * cotangent).backward()
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("chunk", [1, 5, 26, 1000, 0])
def test_equals_torchtitans_loss_forward_and_backward(chunk):
    """Chunks of 1, not dividing the 26 tokens, exactly 26, more than 26, and automatic: fp32 rounding."""
    hidden, weight, labels = _inputs()
    expected = _loss_and_grads(_reference, hidden, weight, labels)
    actual = _loss_and_grads(lambda h, w, y: linear_cross_entropy_sum(h, w, y, chunk), hidden, weight, labels)
    for name, a, e in zip(("loss", "hidden grad", "weight grad"), actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=name)


def test_ignored_labels_add_nothing_and_get_no_gradient():
    hidden, weight, labels = _inputs()
    labels[:] = -100
    labels[1, 3] = 5
    loss, grad_hidden, _ = _loss_and_grads(lambda h, w, y: linear_cross_entropy_sum(h, w, y, 4), hidden, weight, labels)
    torch.testing.assert_close(loss, _reference(hidden, weight, labels))
    assert grad_hidden[0].abs().max() == 0 and grad_hidden[1, 3].abs().max() > 0


def test_bf16_matches_torchtitans_rounding():
    """In bf16 the logits are rounded to bf16 before fp32, and the weight's gradient adds up in fp32."""
    hidden, weight, labels = _inputs(seq=64, dim=32, vocab=50, dtype=torch.bfloat16)
    expected = _loss_and_grads(_reference, hidden, weight, labels)
    actual = _loss_and_grads(lambda h, w, y: linear_cross_entropy_sum(h, w, y, 16), hidden, weight, labels)
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-6, atol=1e-6)
    for a, e in zip(actual[1:], expected[1:]):
        torch.testing.assert_close(a.float(), e.float(), rtol=2e-2, atol=1e-2)


VOCAB_SHARDED = 37  # odd: DTensor gives rank 0 19 rows, rank 1 18


def _tp_case(rank, mesh, sequence_parallel: bool):
    from torch.distributed.tensor import Shard, distribute_tensor

    hidden, weight, labels = _inputs(seq=12, vocab=VOCAB_SHARDED)
    expected = _loss_and_grads(_reference, hidden, weight, labels)
    sharded = nn.Parameter(distribute_tensor(weight, mesh, (Shard(0),)))
    if sequence_parallel:  # the final norm's output: a DTensor sharded on the sequence
        local = hidden.chunk(2, dim=1)[rank].clone().requires_grad_()
        inp = torch.distributed.tensor.DTensor.from_local(local, mesh, (Shard(1),))
    else:  # replicated, as a plain tensor
        local = inp = hidden.clone().requires_grad_()
    loss = tp_linear_cross_entropy_sum(inp, sharded, labels, chunk_tokens=5)
    (loss * 0.37).backward()
    grad_hidden = local.grad
    expected_hidden = expected[1].chunk(2, dim=1)[rank] if sequence_parallel else expected[1]
    return {
        "loss": (loss - expected[0]).abs().item() / expected[0].abs().item(),
        "hidden": ((grad_hidden - expected_hidden).norm() / expected_hidden.norm()).item(),
        "weight": ((sharded.grad.full_tensor() - expected[2]).norm() / expected[2].norm()).item(),
    }


def _tp_cases(rank, mesh):
    return {sp: _tp_case(rank, mesh, sp) for sp in (True, False)}


def test_vocab_sharded_head_on_two_ranks_equals_one_process():
    """TP2 (loss parallel: each rank its vocabulary slice) with and without sequence parallel, uneven shards."""
    results = on_forked_ranks(2, _tp_cases)
    for rank in range(2):
        for sp, errors in results[rank].items():
            for what, error in errors.items():
                assert error <= 1e-5, f"rank {rank} sequence_parallel={sp} {what}: relative error {error:.1e}"


def _tiny_llama(tie: bool):
    from titan_ext.models.adapter import build_model
    from titan_ext.models.llama import llama_flavors

    args = copy.deepcopy(llama_flavors["debugmodel"])
    args.config.update(vocab_size=96, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    return model


@pytest.mark.parametrize("tie", [True, False])
def test_a_model_whose_head_runs_in_the_loss_equals_its_logits_through_torchtitans_loss(tie):
    from titan_ext.job_plan import LossChoice
    from titan_ext.models import loss as job_loss

    full = _tiny_llama(tie)
    chunked = copy.deepcopy(full)
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = tokens.roll(-1, 1)
    labels[:, -1] = -100
    loss_fn = job_loss.build_loss(job_config(config_file=DEBUG_LLAMA_TOML))
    expected = loss_fn(full(tokens), labels)
    choice = LossChoice(chunk_tokens=7)
    assert plan_forward(chunked, loss=choice).head_in_loss
    job_loss.apply_chunked_loss(chunked, choice)
    hidden = chunked(tokens)
    assert hidden.shape == (2, 24, full.config.hidden_size)  # no logits
    actual = loss_fn(hidden, labels)
    expected.backward()
    actual.backward()
    torch.testing.assert_close(actual, expected)
    for (name, p), q in zip(full.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_finished_jobs_loss_keeps_no_head():
    """The loss being built is held weakly: once the job's trainer drops it, its head (under FSDP with the
    job's process groups) is not kept for the next job of a process, nor bound to that job's model."""
    import gc

    from titan_ext.job_plan import LossChoice
    from titan_ext.models import loss as job_loss

    loss_fn = job_loss.build_loss(job_config(config_file=DEBUG_LLAMA_TOML))
    job_loss.apply_chunked_loss(_tiny_llama(False), LossChoice(chunk_tokens=7))
    assert loss_fn.head is not None
    del loss_fn
    gc.collect()
    assert job_loss._building() is None


# ---- refusals --------------------------------------------------------------------------------------


def _choice(*flags, model=None, float8_filters=None):
    from titan_ext.models.loss import loss_choice

    return loss_choice(model or _tiny_llama(False), job_config(*flags, config_file=DEBUG_GLA_TOML), float8_filters)


def test_full_is_the_default_and_chunked_is_planned():
    assert _choice() is None
    assert _choice("--titan_ext.loss", "chunked", "--titan_ext.loss_chunk_tokens", "64").chunk_tokens == 64


@pytest.mark.parametrize("flags, expected", [
    (("--titan_ext.loss", "fused"), "--titan_ext.loss='fused' is not one of ['full', 'chunked']"),
    (("--titan_ext.loss", "chunked", "--titan_ext.loss_chunk_tokens", "-1"), "--titan_ext.loss_chunk_tokens=-1 is negative"),
])
def test_bad_options_are_one_line_errors(flags, expected):
    with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        _choice(*flags)


def test_a_head_with_a_bias_is_refused():
    model = _tiny_llama(False)
    model.lm_head = nn.Linear(model.config.hidden_size, 96, bias=True)
    with pytest.raises(ConfigError, match="lm_head is Linear with a bias; use --titan_ext.loss full"):
        _choice("--titan_ext.loss", "chunked", model=model)


def test_a_head_float8_would_convert_is_refused():
    with pytest.raises(ConfigError, match="add 'lm_head' to --quantize.linear.float8.filter_fqns"):
        _choice("--titan_ext.loss", "chunked", float8_filters=("mlp",))
    assert _choice("--titan_ext.loss", "chunked", float8_filters=("lm_head",)) is not None


def test_the_tp_plan_only_places_the_head_weight_when_the_loss_runs_the_head():
    """No input or output layouts on the head (the loss calls it with hidden states and labels): its weight
    sharded on the vocabulary, as the embedding's, so a tied head keeps one weight."""
    from model_plans import TPOptions
    from model_plans import TPPlan
    from model_plans.styles import PlaceParameters
    from torch.distributed.tensor import Shard

    style = TPPlan(TPOptions(head_in_loss=True)).model_plan()["lm_head"].style
    assert isinstance(style, PlaceParameters) and style.placement == Shard(0)
