"""The portable (non-CUDA) kernel path: titan_ext's torch implementations of fla's kernels.

Runs on CPU only. The replacements are called directly (``titan_ext.kernels.*``)
or through fla modules bound with ``titan_ext.kernels.portable``; fla itself is
never changed. References are fla's own pure-torch ``naive_recurrent_gla`` and
explicit torch formulas; every comparison covers forward and gradients.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import fla.layers.gla
import fla.modules.activations
import fla.ops.gla
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fla.layers.gla import GatedLinearAttention
from fla.models import GLAConfig, GLAForCausalLM
from fla.modules import (
    FusedCrossEntropyLoss,
    FusedLinearCrossEntropyLoss,
    FusedRMSNormGated,
    GatedMLP,
    RMSNorm,
    ShortConvolution,
)
from fla.ops.delta_rule import chunk_delta_rule
from fla.ops.gla.naive import naive_recurrent_gla
from helpers import assert_rel_close, backward_with_random_cotangents, gla_inputs, leaves

import titan_ext.kernels as kernels
from titan_ext.kernels import activations, gla as torch_gla, gla_op, norms

# --- binding: one model changes, fla does not -------------------------------------------


def test_every_replacement_resolves_for_both_paths():
    portable, fla_path = kernels.replacements("portable"), kernels.replacements("fla")
    assert len(portable) == sum("portable" in k.paths for k in kernels.kernel_rows())
    # on CUDA: every kernel a training block reaches as torch ops running fla's own drivers (gla_op, kda_op,
    # gated_delta_op, recurrent_gla_op, norm_ops via tp_local's TP unwrap, elementwise_ops, conv_op, rotary_op),
    # the rotary cache check, the layer cache helpers, fla's decoding and standalone kernels opaque behind an
    # unwrap of TP-sharded parameters (tp_local), and Kimi Linear's KDA and convolution calls with their
    # documents packed (transformers_kda)
    import fla.layers.utils
    from fla.layers.gated_deltanet import GatedDeltaNet
    from fla.modules.rotary.ops import RotaryEmbedding
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from titan_ext.kernels import (conv_op, elementwise_ops, gated_delta_op, kda_op, layer_cache, recurrent_gla_op,
                                   rotary, rotary_op, tp_local, transformers_kda)

    assert fla_path == {
        fla.ops.gla.chunk.chunk_gla: gla_op.chunk_gla,
        vars(RotaryEmbedding)["_update_cos_sin_cache"]: rotary.update_cos_sin_cache,
        fla.layers.utils.get_layer_cache: layer_cache.get_layer_cache,
        fla.layers.utils.update_layer_cache: layer_cache.update_layer_cache,
        vars(GatedDeltaNet)["_use_fused_qkv_conv"]: tp_local.use_fused_qkv_conv,
        fla.modules.causal_conv1d.ops.causal_conv1d: conv_op.causal_conv1d,
        fla.modules.causal_conv1d.ops.causal_conv1d_update: tp_local.causal_conv1d_update,
        fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule: gated_delta_op.chunk_gated_delta_rule,
        fla.ops.gated_delta_rule.fused_recurrent.fused_recurrent_gated_delta_rule: tp_local.fused_recurrent_gated_delta_rule,
        fla.ops.kda.chunk.chunk_kda: kda_op.chunk_kda,
        fla.ops.kda.fused_recurrent.fused_recurrent_kda: tp_local.fused_recurrent_kda,
        fla.modules.norm.layernorm.rms_norm: tp_local.rms_norm,
        fla.modules.norm.fused_norm_gate.rms_norm_gated: tp_local.rms_norm_gated,
        fla.modules.activations.ops.swiglu_linear: elementwise_ops.swiglu_linear,
        fla.ops.gla.fused_chunk.fused_chunk_gla: tp_local.fused_chunk_gla,
        fla.ops.gla.fused_recurrent.fused_recurrent_gla: recurrent_gla_op.fused_recurrent_gla,
        fla.modules.activations.ops.swish: tp_local.swish,
        fla.modules.activations.ops.sigmoid: tp_local.sigmoid,
        fla.modules.activations.ops.logsigmoid: tp_local.logsigmoid,
        fla.modules.activations.ops.swiglu: elementwise_ops.swiglu,
        fla.modules.rotary.ops.rotary_embedding: rotary_op.rotary_embedding,
        kimi.chunk_kimi_delta_attention: transformers_kda.fla_chunk_kda,
        kimi.causal_conv1d_fn: transformers_kda.causal_conv1d_fn,
    }
    # what compile keeps in its graph: titan_ext's torch code and ops (fla's drivers inside the ops); fla's
    # decoding and standalone entry points left are opaque to it (tp_local): dynamo never traces into them
    opaque = {fn for fn in fla_path.values() if getattr(fn, "_torchdynamo_disable", False)}
    assert opaque == {tp_local.causal_conv1d_update, tp_local.fused_recurrent_gated_delta_rule,
                      tp_local.fused_recurrent_kda, tp_local.fused_chunk_gla, tp_local.swish, tp_local.sigmoid,
                      tp_local.logsigmoid}
    # the models titan_ext trains: transformers' Gated DeltaNet layers run titan_ext's forward (their mixer's,
    # by what the layer holds: tests/test_structure.py), not a row of the table
    assert not any(Qwen3_5GatedDeltaNet.forward in table or Qwen3NextGatedDeltaNet.forward in table
                   for table in (fla_path, portable))
    assert portable[fla.ops.gla.chunk.chunk_gla] is gla_op.portable_chunk_gla
    assert portable[fla.ops.gla.fused_recurrent.fused_recurrent_gla] is torch_gla.fused_recurrent_gla
    with pytest.raises(ValueError, match="unknown kernel path 'cuda'"):
        kernels.replacements("cuda")


def test_binding_one_model_leaves_fla_and_other_models_alone():
    chunk_gla, swish = fla.layers.gla.chunk_gla, fla.modules.activations.ACT2FN["swish"]
    bound, plain = tiny_gla(), tiny_gla()
    assert kernels.portable(bound) is bound
    layer, plain_layer = bound.model.layers[0].attn, plain.model.layers[0].attn
    assert type(layer) is not GatedLinearAttention and isinstance(layer, GatedLinearAttention)
    assert type(layer).__name__ == "GatedLinearAttention"  # same name, parameter names and state dict keys
    assert type(plain_layer) is GatedLinearAttention
    assert bound.state_dict().keys() == plain.state_dict().keys()
    # fla's module globals are what fla ships
    assert fla.layers.gla.chunk_gla is chunk_gla is fla.ops.gla.chunk.chunk_gla
    assert chunk_gla.__module__ == "fla.ops.gla.chunk"
    assert fla.modules.activations.ACT2FN["swish"] is swish
    assert GatedLinearAttention.forward.__globals__["chunk_gla"] is chunk_gla
    # the bound layer's forward sees titan_ext's op wrapper instead
    assert type(layer).forward.__globals__["chunk_gla"] is gla_op.portable_chunk_gla
    # binding again is a no-op (classes are cached, nothing is wrapped twice)
    kernels.portable(bound)
    assert type(bound.model.layers[0].attn) is type(layer)


def _checkpointing(forward):
    """Wraps a layer's forward as transformers >= 5.2x does: the wrapper's own code names no kernel."""

    @functools.wraps(forward)
    def forward_with_checkpointing(self, *args, **kwargs):
        return forward(self, *args, **kwargs)

    return forward_with_checkpointing


class _DeltaRuleBlock(nn.Module):
    @_checkpointing
    def forward(self, q, k, v, beta):
        return chunk_delta_rule(q, k, v, beta)


class _OneBlockModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.config, self.layers = SimpleNamespace(), nn.ModuleList([_DeltaRuleBlock()])

    def get_decoder(self):
        return self


def test_unported_kernels_are_read_through_decorators():
    assert kernels.unported(_OneBlockModel()) == {"fla.ops.delta_rule.chunk.chunk_delta_rule": "_DeltaRuleBlock.forward"}


def test_unported_kernels_count_a_feature_only_when_the_config_turns_it_on():
    assert kernels.unported(kernels.portable(tiny_gla())) == {}
    with_attnres = kernels.portable(tiny_gla(attnres_block_size=2))
    assert kernels.unported(with_attnres) == {"fla.ops.attnres.fused.fused_attnres": "GLABlock.forward"}


@pytest.mark.parametrize("model_type", ["gla", "gated_deltanet"])
def test_bound_layers_read_no_layer_index_without_a_cache(model_type):
    """torch 2.11's dynamo guards on an integer a compiled block reads; fla's cache helpers read the
    layer's ``layer_idx`` on every call, so each block compiled anew (``titan_ext.kernels.layer_cache``)."""
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    if model_type == "gla":
        model = tiny_gla()
    else:
        model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(hidden_size=64, num_hidden_layers=2, num_heads=4,
                                                             head_dim=16, vocab_size=128))
    kernels.portable(model)
    reads = []
    for block in model.model.layers:
        block.attn.__class__ = type("Spy", (type(block.attn),), {"layer_idx": property(lambda _: reads.append(1))})
    model(tokens()).logits.sum().backward()
    assert reads == []


# --- GLA ------------------------------------------------------------------------------

SHAPES = [(2, 37, 3, 8, 16), (1, 64, 2, 16, 8), (2, 5, 1, 4, 4), (1, 50, 2, 32, 32)]


@pytest.mark.parametrize("with_h0", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_torch_gla_matches_naive_recurrent_gla(shape, with_h0):
    inputs = gla_inputs(*shape, with_h0=with_h0)
    ours, ref = leaves(*inputs), leaves(*inputs)
    o, ht = torch_gla.chunk_gla(*ours[:4], initial_state=ours[4], output_final_state=True)
    o_ref, ht_ref = naive_recurrent_gla(*ref[:4], initial_state=ref[4], output_final_state=True)
    assert_rel_close(o, o_ref, what="o")
    assert_rel_close(ht, ht_ref, what="final state")
    backward_with_random_cotangents([o, ht])
    backward_with_random_cotangents([o_ref, ht_ref])
    for name, a, b in zip(["dq", "dk", "dv", "dgk", "dh0"], ours, ref):
        if a is not None:
            assert_rel_close(a.grad, b.grad, what=name)


def test_torch_gla_is_stable_for_strong_decay():
    q, k, v, _, h0 = gla_inputs(2, 48, 2, 8, 8)
    gk = F.logsigmoid(60 * torch.randn(q.shape, generator=torch.Generator().manual_seed(3)))  # down to ~ -150
    gk = leaves(gk)[0]
    o, ht = torch_gla.chunk_gla(q, k, v, gk, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = naive_recurrent_gla(q, k, v, gk.detach(), h0, True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert_rel_close(o, o_ref, tol=1e-4, what="o")
    o.sum().backward()
    assert torch.isfinite(gk.grad).all()


# What a bound model calls in place of fla's three public GLA entry points.
GLA_OPS = {
    "chunk_gla": gla_op.portable_chunk_gla,
    "fused_chunk_gla": torch_gla.fused_chunk_gla,
    "fused_recurrent_gla": torch_gla.fused_recurrent_gla,
}


@pytest.mark.parametrize("name", list(GLA_OPS))
def test_gla_replacements_match_naive_recurrent_gla(name):
    op = GLA_OPS[name]
    assert kernels.replacements("portable")[getattr(fla.ops.gla, name)] is op
    q, k, v, gk, h0 = gla_inputs(2, 45, 2, 8, 16)
    ours, ref = leaves(q, k, v, gk, h0), leaves(q, k, v, gk, h0)
    gate = "gk" if name == "fused_recurrent_gla" else "g"
    o, ht = op(q=ours[0], k=ours[1], v=ours[2], **{gate: ours[3]}, initial_state=ours[4], output_final_state=True)
    o_ref, ht_ref = naive_recurrent_gla(*ref[:4], initial_state=ref[4], output_final_state=True)
    assert o.dtype == q.dtype and ht.dtype == torch.float32
    assert_rel_close(o, o_ref, what=f"{name} o")
    assert_rel_close(ht, ht_ref, what=f"{name} final state")
    backward_with_random_cotangents([o, ht])
    backward_with_random_cotangents([o_ref, ht_ref])
    for grad_name, a, b in zip(["dq", "dk", "dv", "dgk", "dh0"], ours, ref):
        assert_rel_close(a.grad, b.grad, what=f"{name} {grad_name}")


@pytest.mark.parametrize("chunk_gla", [torch_gla.chunk_gla, gla_op.portable_chunk_gla], ids=["torch", "op"])
def test_gla_scale_state_v_first_and_no_final_state(chunk_gla):
    q, k, v, gk, h0 = gla_inputs(1, 20, 2, 8, 4)
    o, ht = chunk_gla(q, k, v, gk, scale=0.3, initial_state=h0.transpose(-1, -2).contiguous(),
                      output_final_state=True, state_v_first=True)
    # naive_recurrent_gla always scales by K ** -0.5: fold the requested scale into q
    o_ref, ht_ref = naive_recurrent_gla(q * 0.3 / 8 ** -0.5, k, v, gk, h0, True)
    assert_rel_close(o, o_ref, what="o")
    assert_rel_close(ht, ht_ref.transpose(-1, -2), what="state_v_first final state")
    assert chunk_gla(q, k, v, gk)[1] is None


def loop_gla(q, k, v, gk, gv, h0, reverse=False):
    """Per-token reference with both key and value decays (fla's fused_recurrent semantics)."""
    B, T, H, K = q.shape
    h = h0.clone() if h0 is not None else q.new_zeros(B, H, K, v.shape[-1])
    o = torch.zeros_like(v)
    for t in (reversed(range(T)) if reverse else range(T)):
        h = h * gk[:, t].exp()[..., None] * gv[:, t].exp()[..., None, :] + k[:, t, ..., None] * v[:, t, ..., None, :]
        o[:, t] = (q[:, t, ..., None] * K ** -0.5 * h).sum(-2)
    return o, h


@pytest.mark.parametrize("reverse", [False, True])
def test_fused_recurrent_gla_with_value_gate_and_reverse(reverse):
    q, k, v, gk, h0 = gla_inputs(2, 29, 2, 4, 6)
    gv = F.logsigmoid(torch.randn(v.shape, generator=torch.Generator().manual_seed(5)))
    ours, ref = leaves(q, k, v, gk, gv, h0), leaves(q, k, v, gk, gv, h0)
    o, ht = torch_gla.fused_recurrent_gla(*ours[:3], gk=ours[3], gv=ours[4], initial_state=ours[5],
                                          output_final_state=True, reverse=reverse)
    o_ref, ht_ref = loop_gla(*ref, reverse=reverse)
    assert_rel_close(o, o_ref, what="o")
    assert_rel_close(ht, ht_ref, what="final state")
    backward_with_random_cotangents([o, ht])
    backward_with_random_cotangents([o_ref, ht_ref])
    for a, b in zip(ours, ref):
        assert_rel_close(a.grad, b.grad, what="grad")


@pytest.mark.parametrize("chunk_gla", [torch_gla.chunk_gla, gla_op.portable_chunk_gla], ids=["torch", "op"])
def test_gla_cu_seqlens_matches_separate_sequences(chunk_gla):
    lengths = [7, 33, 1, 20]
    seqs = [gla_inputs(1, n, 2, 8, 8, seed=i) for i, n in enumerate(lengths)]
    packed = [torch.cat([s[j] for s in seqs], dim=1) for j in range(4)]
    h0 = torch.cat([s[4] for s in seqs], dim=0)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    o, ht = chunk_gla(*packed, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    refs = [naive_recurrent_gla(*s, output_final_state=True) for s in seqs]
    assert_rel_close(o, torch.cat([r[0] for r in refs], dim=1), what="packed o")
    assert_rel_close(ht, torch.cat([r[1] for r in refs], dim=0), what="packed final states")


@pytest.mark.parametrize("chunk_gla", [torch_gla.chunk_gla, gla_op.portable_chunk_gla], ids=["torch", "op"])
def test_gla_traces_without_graph_breaks(chunk_gla):
    q, k, v, gk, _ = gla_inputs(2, 40, 2, 8, 8)

    def f(q, k, v, gk):
        return chunk_gla(q=q, k=k, v=v, g=gk, state_v_first=True)[0]

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    assert_rel_close(compiled(q, k, v, gk), f(q, k, v, gk), tol=1e-6, what="compiled o")


def test_bound_gla_layer_compiles_without_graph_breaks():
    torch.manual_seed(0)
    layer = kernels.portable(GatedLinearAttention(hidden_size=32, num_heads=2, mode="chunk", layer_idx=0))
    x = torch.randn(2, 70, 32)  # > 64 tokens, or the layer picks fused_recurrent
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    assert_rel_close(compiled(x)[0], layer(x)[0], tol=1e-6, what="compiled layer")


# --- norms, activations, convolution, losses --------------------------------------------


def rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def check_same(fn_ours, fn_ref, *inputs, tol=1e-5):
    """Forward outputs and input gradients of two functions agree."""
    ours, ref = leaves(*inputs), leaves(*inputs)
    out, out_ref = fn_ours(*ours), fn_ref(*ref)
    out = out if isinstance(out, tuple) else (out,)
    out_ref = out_ref if isinstance(out_ref, tuple) else (out_ref,)
    for a, b in zip(out, out_ref, strict=True):
        assert a.dtype == b.dtype
        assert_rel_close(a, b, tol=tol, what="output")
    backward_with_random_cotangents(out)
    backward_with_random_cotangents(out_ref)
    for a, b in zip(ours, ref):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            assert_rel_close(a.grad, b.grad, tol=tol, what="grad")


@pytest.mark.parametrize("mode", ["plain", "residual", "prenorm"])
def test_rms_norm(mode):
    norm = kernels.portable(RMSNorm(32, eps=1e-6))
    torch.nn.init.normal_(norm.weight)
    x, res, w = torch.randn(3, 5, 32), torch.randn(3, 5, 32), norm.weight.detach()

    def ours(x, res, w):
        if mode == "plain":
            return torch.func.functional_call(norm, {"weight": w}, (x,))
        return torch.func.functional_call(norm, {"weight": w}, (x, res), {"prenorm": mode == "prenorm"})

    def ref(x, res, w):
        if mode == "plain":
            return rms(x, 1e-6) * w
        s = x + res
        return (rms(s, 1e-6) * w, s) if mode == "prenorm" else rms(s, 1e-6) * w

    check_same(ours, ref, x, res, w)
    check_same(lambda x, w: norms.rms_norm(x, w, None, eps=1e-6), lambda x, w: rms(x, 1e-6) * w, x, w)


def test_rms_norm_weight_grad_and_dtype():
    norm = kernels.portable(RMSNorm(16, eps=1e-5))
    x = torch.randn(4, 16)
    norm(x).pow(2).sum().backward()
    w = torch.ones(16, requires_grad=True)
    (rms(x, 1e-5) * w).pow(2).sum().backward()
    assert_rel_close(norm.weight.grad, w.grad, what="dweight")
    y, residual = norm(x.bfloat16(), x.bfloat16(), prenorm=True, residual_in_fp32=True)
    assert y.dtype == torch.bfloat16 and residual.dtype == torch.bfloat16  # residual keeps its dtype
    assert norm(x.bfloat16(), prenorm=True, residual_in_fp32=True)[1].dtype == torch.float32


@pytest.mark.parametrize("activation", ["swish", "sigmoid"])
def test_fused_rms_norm_gated(activation):
    gnorm = kernels.portable(FusedRMSNormGated(16, eps=1e-5, activation=activation))
    with torch.no_grad():
        gnorm.weight.normal_()
    w = gnorm.weight.detach().clone()
    act = (lambda g: g * torch.sigmoid(g)) if activation == "swish" else torch.sigmoid
    check_same(lambda x, g: gnorm(x, g), lambda x, g: rms(x, 1e-5) * w * act(g),
               torch.randn(2, 7, 3, 16), torch.randn(2, 7, 3, 16))
    x = torch.randn(4, 16, requires_grad=True)
    gnorm(x, x).sum().backward()
    assert gnorm.weight.grad is not None and torch.isfinite(gnorm.weight.grad).all()


def test_activations():
    x, y = torch.randn(4, 9, 24), torch.randn(4, 9, 24)
    check_same(activations.swish, lambda x: x * torch.sigmoid(x), x)
    check_same(activations.sigmoid, torch.sigmoid, x)
    check_same(activations.logsigmoid, F.logsigmoid, x)
    check_same(activations.swiglu, lambda x, y: x * torch.sigmoid(x) * y, x, y)
    assert activations.swish(x.bfloat16()).dtype == torch.bfloat16

    weight, bias = torch.randn(10, 24), torch.randn(10)
    check_same(activations.swiglu_linear, lambda x, y, w, b: (x * torch.sigmoid(x) * y) @ w.T + b,
               x, y, weight, bias)
    # what a bound fla module calls for ACT2FN["swish"]
    assert kernels.replacements("portable")[fla.modules.activations.ACT2FN["swish"]] is activations.swish


@pytest.mark.parametrize("fuse_swiglu", [True, False])
def test_bound_gated_mlp(fuse_swiglu):
    torch.manual_seed(0)
    mlp = kernels.portable(GatedMLP(hidden_size=24, intermediate_size=40, hidden_act="swish", fuse_swiglu=fuse_swiglu))
    params = dict(mlp.named_parameters())

    def ref(x, gate, up, down):
        return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T

    weights = [params[f"{n}.weight"].detach() for n in ("gate_proj", "up_proj", "down_proj")]
    check_same(
        lambda x, g, u, d: torch.func.functional_call(
            mlp, {"gate_proj.weight": g, "up_proj.weight": u, "down_proj.weight": d}, (x,), strict=False),
        ref, torch.randn(3, 5, 24), *weights,
    )


def test_short_convolution():
    conv = kernels.portable(ShortConvolution(hidden_size=12, kernel_size=4, bias=True, activation="silu"))
    x = torch.randn(2, 9, 12)

    def ref(x):
        full = torch.nn.Conv1d.forward(conv, x.transpose(1, 2))  # padding W-1 on both sides
        return F.silu(full[..., : x.shape[1]]).transpose(1, 2)

    check_same(lambda x: conv(x)[0], ref, x)
    # the final state, fed back as a cache, continues the sequence exactly
    y_full, _ = conv(x)
    y_a, state = conv(x[:, :6], output_final_state=True)
    y_b, _ = conv(x[:, 6:], cache=state)
    assert_rel_close(torch.cat([y_a, y_b], 1), y_full, what="conv with cache")


def test_short_convolution_of_packed_sequences_sees_each_sequence_alone():
    conv = kernels.portable(ShortConvolution(hidden_size=12, kernel_size=4, bias=True, activation="silu"))
    lengths = [5, 1, 2, 9]  # shorter and longer than the kernel
    x = torch.randn(1, sum(lengths), 12, requires_grad=True)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    alone = torch.cat([conv(part)[0] for part in x.split(lengths, dim=1)], dim=1)
    packed, _ = conv(x, cu_seqlens=cu_seqlens)  # training: tensor ops, no loop over sequences
    looped, states = conv(x, cu_seqlens=cu_seqlens, output_final_state=True)  # with states: one by one
    assert_rel_close(packed, alone, tol=1e-6, what="packed conv")
    assert_rel_close(looped, alone, tol=1e-6, what="packed conv with final states")
    assert states.shape[0] == len(lengths)
    grad = torch.randn_like(alone)
    (g_alone,) = torch.autograd.grad(alone, x, grad)
    (g_packed,) = torch.autograd.grad(packed, x, grad)
    assert_rel_close(g_packed, g_alone, tol=1e-6, what="packed conv gradient")


def test_cross_entropy_losses():
    from titan_ext.kernels import losses

    logits, target = torch.randn(12, 30), torch.randint(0, 30, (12,))
    target[3] = -100
    for smoothing in (0.0, 0.1):
        loss = kernels.portable(FusedCrossEntropyLoss(label_smoothing=smoothing))
        check_same(
            lambda z: loss(z, target),
            lambda z: F.cross_entropy(z, target, label_smoothing=smoothing),
            logits,
        )
    x, weight = torch.randn(12, 8), torch.randn(30, 8)
    check_same(
        lambda x, w: losses.fused_linear_cross_entropy_loss(x, target, w),
        lambda x, w: F.cross_entropy(x @ w.T, target),
        x, weight,
    )


# fla builds its loss module inside the model's forward (fla.models.modeling_utils), so binding
# the model must reach the class, not only instances that exist at bind time.
def test_bound_fused_linear_cross_entropy_module():
    x, weight, target = torch.randn(12, 8), torch.randn(30, 8), torch.randint(0, 30, (12,))
    loss = kernels.portable(FusedLinearCrossEntropyLoss())
    assert_rel_close(loss(x, target, weight), F.cross_entropy(x @ weight.T, target), what="loss")


@pytest.mark.parametrize("fused", ["fuse_cross_entropy", "fuse_linear_cross_entropy"])
def test_bound_gla_model_loss_with_labels(fused):
    flags = {"fuse_cross_entropy": fused == "fuse_cross_entropy", "fuse_linear_cross_entropy": fused != "fuse_cross_entropy"}
    model = kernels.portable(tiny_gla(**flags))
    x = tokens()
    loss = model(input_ids=x, labels=x).loss
    logits = model(input_ids=x).logits
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    assert_rel_close(loss, expected, what="model loss")


def test_dtensor_on_cpu_takes_the_torch_path(gloo_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    q, k, v, gk, _ = gla_inputs(1, 20, 2, 8, 8)
    dq, dk, dv, dgk = (distribute_tensor(t, mesh, [Shard(2)]) for t in (q, k, v, gk))
    o_ref, ht_ref = naive_recurrent_gla(q, k, v, gk, output_final_state=True)
    for chunk_gla in (gla_op.portable_chunk_gla, torch_gla.chunk_gla):  # the op wrapper hands DTensors to the torch GLA
        o, ht = chunk_gla(dq, dk, dv, dgk, output_final_state=True)
        assert isinstance(o, DTensor)
        assert_rel_close(o.full_tensor(), o_ref, what="DTensor o")
        assert_rel_close(ht.full_tensor(), ht_ref, what="DTensor final state")


# --- whole model -----------------------------------------------------------------------


def tiny_gla(**overrides):
    config = dict(hidden_size=64, num_hidden_layers=2, num_heads=4, vocab_size=128)
    torch.manual_seed(0)
    return GLAForCausalLM(GLAConfig(**{**config, **overrides}))


def tokens(T=80):  # > 64 tokens, or the layer always picks fused_recurrent
    return torch.randint(0, 128, (2, T), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("fuse_swiglu", [True, False])
@pytest.mark.parametrize("fuse_norm", [True, False])
def test_gla_model_forward_backward(fuse_norm, fuse_swiglu):
    # torch's loss: see test_bound_gla_model_loss_with_labels for fla's fused one
    model = kernels.portable(tiny_gla(fuse_norm=fuse_norm, fuse_swiglu=fuse_swiglu, fuse_cross_entropy=False))
    x = tokens()
    loss = model(input_ids=x, labels=x).loss
    assert torch.isfinite(loss) and 3.0 < loss.item() < 7.0  # ~ln(128) at init
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0


def test_gla_model_short_conv_and_torch_loss():
    model = kernels.portable(tiny_gla(use_short_conv=True, fuse_cross_entropy=False))
    x = tokens()
    out = model(input_ids=x, labels=x)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert torch.isfinite(model.model.layers[0].attn.q_conv1d.weight.grad).all()


def test_gla_model_attn_modes_agree():
    x = tokens()
    base = kernels.portable(tiny_gla(attn_mode="chunk"))
    logits = {"chunk": base(input_ids=x).logits}
    for mode in ("fused_recurrent", "fused_chunk"):
        model = kernels.portable(tiny_gla(attn_mode=mode))
        model.load_state_dict(base.state_dict())
        logits[mode] = model(input_ids=x).logits
    assert_rel_close(logits["fused_recurrent"], logits["chunk"], what="fused_recurrent vs chunk logits")
    assert_rel_close(logits["fused_chunk"], logits["chunk"], what="fused_chunk vs chunk logits")


def test_gla_model_incremental_decoding_matches_full_forward():
    """Exercises every state convention: GLA state (state_v_first), conv caches, conv decode step."""
    model = kernels.portable(tiny_gla(use_short_conv=True)).eval()
    x = tokens(T=73)
    with torch.no_grad():
        full = model(input_ids=x).logits
        out = model(input_ids=x[:, :70], use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        for t in range(70, 73):
            out = model(input_ids=x[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.past_key_values
    assert_rel_close(torch.cat(steps, dim=1), full, what="incremental logits")


GENERATE = """
import torch
from titan_ext import pretrained
model = pretrained.from_pretrained({path!r})
out = model.generate(input_ids=torch.tensor([[1, 5, 9]]), max_new_tokens=3, do_sample=False)
print(out.shape[1])
"""


def test_from_pretrained_and_generate_keep_the_console_quiet(tmp_path):
    """A fresh process (the libraries' notices come once, at import): nothing on stderr but transformers' own
    progress bar; warnings still reach the user's own code after the call."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from helpers import REPO, without_fla_python_notice

    # no end-of-sequence token: random weights that pick it would end generate early
    config = GLAConfig(hidden_size=64, num_hidden_layers=2, num_heads=2, vocab_size=64, fuse_norm=False,
                       eos_token_id=None)
    kernels.portable(AutoModelForCausalLM.from_config(config)).save_pretrained(tmp_path)
    code = GENERATE.format(path=str(tmp_path)) + "import warnings; warnings.warn('the user\\'s own warning')\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.split() == ["6"], proc.stdout + proc.stderr
    lines = [line for line in without_fla_python_notice(proc.stderr).replace("\r", "\n").splitlines() if line.strip()]
    # the user's warning and the source line Python shows under it (from 3.13 the whole line of ``-c`` code)
    noise = [line for line in lines if not line.startswith("Loading weights") and "s own warning" not in line]
    assert noise == [], "\n".join(noise)
    assert any("the user's own warning" in line for line in lines)  # the quiet ends with the call


# --- fla's other linear-attention layers on the portable kernels -------------------------------------------

@pytest.mark.parametrize(("model_type", "options"), [
    ("delta_net", dict(num_heads=2)),  # chunk/fused_recurrent_delta_rule, l2norm
    ("linear_attn", dict(num_heads=2)),  # chunk/fused_recurrent_linear_attn
    ("retnet", dict(num_heads=2)),  # chunk/fused_recurrent retention
    ("mamba2", dict(num_heads=8, head_dim=16, n_groups=1)),  # fla's Mamba2: its torch scan, RMSNormGated's rmsnorm_fn
])
def test_fla_linear_attention_models_train_and_decode_on_the_portable_kernels(model_type, options):
    """Each of these fla model types reached a Triton kernel on the CPU; bound, none is left (``unported``), a
    training step's gradients are finite, and decoding from the cache equals the full forward."""
    import fla  # noqa: F401  (registers fla's model types)
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    torch.manual_seed(0)
    model = kernels.portable(AutoModelForCausalLM.from_config(
        CONFIG_MAPPING[model_type](hidden_size=64, num_hidden_layers=2, vocab_size=64, **options)))
    assert kernels.unported(model) == {}
    x = torch.randint(0, 64, (2, 70), generator=torch.Generator().manual_seed(0))  # > 64: the layers' chunk mode
    model(input_ids=x, labels=x).loss.backward()
    assert all(p.grad.isfinite().all() for p in model.parameters() if p.grad is not None)
    model.eval()
    with torch.no_grad():
        full = model(input_ids=x).logits
        prefix = model(input_ids=x[:, :69], use_cache=True)
        step = model(input_ids=x[:, 69:], past_key_values=prefix.past_key_values, use_cache=True).logits
    assert_rel_close(step[:, -1], full[:, 69], tol=1e-5, what="cached decoding step")
