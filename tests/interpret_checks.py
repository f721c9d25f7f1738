"""fla's Triton kernels (the GPU code path) under Triton's interpreter on the CPU, against titan_ext's portable ones.

    TRITON_INTERPRET=1 python tests/interpret_checks.py [CASE ...]   # every case of CASES, or those named

Two independent implementations agreeing: each fla kernel entry titan_ext's models call, forward and
backward, with initial and final states and ``cu_seqlens``; GLA and Gated DeltaNet under context
parallelism on fla's kernels (2 gloo ranks) against one process; Gated DeltaNet under TP=2 on fla's
kernels against one process; fla's KDA kernels (and, by name, ``cp_kda`` and ``tp_kda``: KDA under CP=2 and
TP=2 on fla's kernels; ``OPT_IN``). Prints one JSON line per case: ``{"case", "worst", "tol", "seconds"}``
(``worst``: the largest relative difference of any output or gradient). ``tests/test_interpret.py``
runs it once (a process of its own: TRITON_INTERPRET must be set before fla is imported).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from titan_ext import patching
from titan_ext.kernels import host_patches as kernel_patches  # noqa: E402

patching.apply_once(kernel_patches.INTERPRETER)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def leaves(*shapes_and_makers, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape, make in shapes_and_makers:
        out.append(make(torch.randn(*shape, generator=g)).requires_grad_())
    return out


def compare(fla_fn, ours_fn, inputs, **kwargs) -> float:
    """Outputs (and final states) and the gradients of every input of two implementations."""
    copies = [[x.detach().clone().requires_grad_() for x in inputs] for _ in range(2)]
    results = []
    for fn, xs in zip((fla_fn, ours_fn), copies):
        out = fn(*xs, **kwargs)
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
        weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(7 + i)) for i, o in enumerate(outs)]
        sum((o.float() * w).sum() for o, w in zip(outs, weights)).backward()
        results.append((outs, [x.grad for x in xs]))
    (fo, fg), (oo, og) = results
    assert len(fo) == len(oo), (len(fo), len(oo))
    return max(rel(a, b) for a, b in zip(fo + fg, oo + og))


T = 70  # more than one 64-token chunk
CU = torch.tensor([0, 23, 70])  # two sequences packed in one row (cu_seqlens)


def gla_inputs(B, H=2, K=16, V=16, states=1):
    return leaves(((B, T, H, K), lambda x: x), ((B, T, H, K), lambda x: x), ((B, T, H, V), lambda x: x),
                  ((B, T, H, K), lambda x: F.logsigmoid(x) / 4), ((states, H, K, V), lambda x: x))


def case_chunk_gla(packed: bool):
    import fla.ops.gla as fla_gla

    from titan_ext.kernels import gla_op

    q, k, v, g, h0 = gla_inputs(1 if packed else 2, states=2)
    kwargs = dict(output_final_state=True, cu_seqlens=CU if packed else None)
    shipped = compare(lambda *x, **kw: fla_gla.chunk_gla(*x[:4], initial_state=x[4], **kw),
                      lambda *x, **kw: gla_op.portable_chunk_gla(*x[:4], initial_state=x[4], **kw), [q, k, v, g, h0], **kwargs)
    op = compare(lambda *x, **kw: gla_op.chunk_gla(*x[:4], initial_state=x[4], **kw),  # the fla path's op
                 lambda *x, **kw: gla_op.portable_chunk_gla(*x[:4], initial_state=x[4], **kw), [q, k, v, g, h0], **kwargs)
    return max(shipped, op)


def case_fused_recurrent_gla(packed: bool):
    import fla.ops.gla as fla_gla

    from titan_ext.kernels import gla

    q, k, v, g, h0 = gla_inputs(1 if packed else 2, states=2)
    return compare(lambda *x, **kw: fla_gla.fused_recurrent_gla(*x[:3], gk=x[3], initial_state=x[4], **kw),
                   lambda *x, **kw: gla.fused_recurrent_gla(*x[:3], gk=x[3], initial_state=x[4], **kw),
                   [q, k, v, g, h0], output_final_state=True, cu_seqlens=CU if packed else None)


def delta_inputs(B, H=2, K=16, V=16, states=2):
    return leaves(((B, T, H, K), lambda x: x), ((B, T, H, K), lambda x: x), ((B, T, H, V), lambda x: x),
                  ((B, T, H), lambda x: F.logsigmoid(x) / 4), ((B, T, H), lambda x: x.sigmoid()),
                  ((states, H, K, V), lambda x: x / 4))


def case_gated_delta_rule(entry: str, packed: bool):
    import fla.ops.gated_delta_rule as fla_delta

    from titan_ext.kernels import gated_delta

    q, k, v, g, beta, h0 = delta_inputs(1 if packed else 2)
    shipped, ours = getattr(fla_delta, entry), getattr(gated_delta, entry)
    if entry.startswith("fused_recurrent"):  # fla's decoding kernel: forward only (fla has no backward for it)
        kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=CU if packed else None)
        with torch.no_grad():
            a = shipped(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, **kwargs)
            b = ours(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, **kwargs)
        return max(rel(x, y) for x, y in zip(a, b))
    return compare(lambda *x, **kw: shipped(q=x[0], k=x[1], v=x[2], g=x[3], beta=x[4], initial_state=x[5], **kw),
                   lambda *x, **kw: ours(q=x[0], k=x[1], v=x[2], g=x[3], beta=x[4], initial_state=x[5], **kw),
                   [q, k, v, g, beta, h0], output_final_state=True, use_qk_l2norm_in_kernel=True,
                   cu_seqlens=CU if packed else None)


def case_kda(entry: str, packed: bool):
    """fla's KDA entry as KimiDeltaAttention calls it: the gate, L2 norms and sigmoid(beta) in the kernel,
    A_log and dt_bias as inputs (with gradients), a V-first state."""
    import fla.ops.kda as fla_kda

    from titan_ext.kernels import kda

    B, H, K, V = 1 if packed else 2, 2, 16, 16
    q, k, v, g, beta, A_log, dt_bias, h0 = leaves(
        ((B, T, H, K), lambda x: x), ((B, T, H, K), lambda x: x), ((B, T, H, V), lambda x: x),
        ((B, T, H, K), lambda x: x), ((B, T, H), lambda x: x), ((H,), lambda x: x / 4), ((H * K,), lambda x: x),
        ((2, H, V, K), lambda x: x / 4))
    shipped, ours = getattr(fla_kda, entry), getattr(kda, entry)
    kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, state_v_first=True, cu_seqlens=CU if packed else None)
    if entry.startswith("fused_recurrent"):  # fla's decoding kernel: forward only
        with torch.no_grad():
            a, b = (fn(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0, **kwargs)
                    for fn in (shipped, ours))
        return max(rel(x, y) for x, y in zip(a, b))
    return compare(
        lambda *x, **kw: shipped(q=x[0], k=x[1], v=x[2], g=x[3], beta=x[4], A_log=x[5], dt_bias=x[6], initial_state=x[7], **kw),
        lambda *x, **kw: ours(q=x[0], k=x[1], v=x[2], g=x[3], beta=x[4], A_log=x[5], dt_bias=x[6], initial_state=x[7], **kw),
        [q, k, v, g, beta, A_log, dt_bias, h0], **kwargs)


def case_kimi_kda():
    """transformers' Kimi Linear KDA call as its layer makes it (the gate and sigmoid(beta) computed outside,
    L2 norms in the kernel) on 2 rows with packed documents as ``cu_seq_lens_q``: fla's kernel on one packed
    row (``transformers_kda.fla_chunk_kda``, the CUDA path) against the portable one."""
    import torch.nn.functional as F

    from titan_ext.kernels import transformers_kda

    B, H, K, V = 2, 2, 16, 16
    q, k, v, g, beta = leaves(((B, T, H, K), lambda x: x), ((B, T, H, K), lambda x: x), ((B, T, H, V), lambda x: x),
                              ((B, T, H, K), lambda x: -F.softplus(x)), ((B, T, H), torch.sigmoid))
    documents = torch.tensor([0, 23, T, T + 40, 2 * T])  # every row starts one
    return compare(lambda *x, **kw: transformers_kda.fla_chunk_kda(*x[:3], g=x[3], beta=x[4], **kw),
                   lambda *x, **kw: transformers_kda.chunk_kda(*x[:3], g=x[3], beta=x[4], **kw),
                   [q, k, v, g, beta], use_qk_l2norm_in_kernel=True, cu_seq_lens_q=documents)


def case_kda_op():
    """fla's ``chunk_kda`` as titan_ext's torch ops (``kernels.kda_op``, the CUDA path's KDA) against fla's
    ``chunk_kda`` as shipped, bit for bit (the same kernels): as KimiDeltaAttention calls it (gates, norms and
    sigmoid(beta) in the kernel, packed, initial and final states) under op-level selective AC, where its
    forward must not run again in backward's recompute; as Kimi Linear calls it (gate and beta outside, a
    K-first state, rows, a scale); grouped values with the lower-bounded gate, 2 * sigmoid(beta), chunk 32.
    And torch's checks of the op's registration (schema, autograd, fake). ~8 s of CPU."""
    from types import SimpleNamespace

    import fla.ops.kda as fla_kda
    from torch.nn import Module
    from torchtitan.config.job_config import ActivationCheckpoint

    from titan_ext import compat
    from titan_ext.kernels import kda_op
    from titan_ext.parallel.activation_checkpoint import ac_choice, wrap_block

    T, H, K, V = 20, 1, 16, 16
    two_sequences = torch.tensor([0, 7, T])  # packed: 7 and 13 tokens, one chunk each
    fla_mixer = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                     state_v_first=True, output_final_state=True)
    ident, third = (lambda x: x), (lambda x: x / 3)

    def inputs(B, HV=H, states=None, v_first=True):
        state = (states or B, HV, V, K) if v_first else (states or B, HV, K, V)
        return leaves(((B, T, H, K), ident), ((B, T, H, K), ident), ((B, T, HV, V), ident), ((B, T, HV, K), ident),
                      ((B, T, HV), ident), ((HV,), third), ((HV * K,), ident), (state, third))

    def call(kernel, **fixed):
        return lambda *x, **kw: kernel(*x[:5], A_log=x[5], dt_bias=x[6], initial_state=x[7], **fixed, **kw)

    class Core(Module):  # one block whose only op is the KDA call, checkpointed as a training job does
        def forward(self, *x):
            return kda_op.chunk_kda(*x[:5], A_log=x[5], dt_bias=x[6], initial_state=x[7], cu_seqlens=two_sequences,
                                    **fla_mixer)

    choice = ac_choice(SimpleNamespace(activation_checkpoint=ActivationCheckpoint(mode="selective",
                                                                                  selective_ac_option="op")))
    block = wrap_block(Core(), 0, choice, base_fqn="layers.0")
    drivers, runs = compat.fla_kda_drivers(), []
    forward = drivers.chunk_kda_fwd
    drivers.chunk_kda_fwd = lambda *a, **kw: runs.append(1) or forward(*a, **kw)
    try:
        sac = compare(call(fla_kda.chunk_kda, cu_seqlens=two_sequences, **fla_mixer), lambda *x: block(*x),
                      inputs(1, states=2))
    finally:
        drivers.chunk_kda_fwd = forward
    assert len(runs) == 1, f"op SAC ran fla's KDA forward {len(runs)} times (once in forward, 0 in backward expected)"

    kimi = dict(use_qk_l2norm_in_kernel=True, output_final_state=True, scale=0.3)
    q, k, v, g, beta, _, _, h0 = inputs(2, v_first=False)
    g, beta = (-F.softplus(g)).detach().requires_grad_(), beta.sigmoid().detach().requires_grad_()
    rows = compare(lambda *x, **kw: fla_kda.chunk_kda(*x[:5], initial_state=x[5], **kw),
                   lambda *x, **kw: kda_op.chunk_kda(*x[:5], initial_state=x[5], **kw), [q, k, v, g, beta, h0], **kimi)

    # (safe_gate's kernel does not run under the interpreter; the op hands fla the flag as it gets it)
    bounded = dict(fla_mixer, lower_bound=-5.0, allow_neg_eigval=True, chunk_size=32)
    gva = compare(call(fla_kda.chunk_kda, **bounded), call(kda_op.chunk_kda, **bounded), inputs(1, HV=2))

    q, k, v, g, beta, A_log, dt_bias, h0 = inputs(1, states=2)
    op_args = (q, k, v, g, beta, A_log, dt_bias, 0.25, h0, True, True, True, True, False, False, None, True,
               two_sequences, None, 64)
    checks = torch.library.opcheck(torch.ops.titan_ext.chunk_kda_fwd.default, op_args,
                                   test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    assert set(checks.values()) == {"SUCCESS"}, checks
    return {"kda_op_sac": sac, "kda_op_rows": rows, "kda_op_gva": gva}


def case_block_ops():
    """The torch ops a compiled block runs on the fla path (``norm_ops``, ``elementwise_ops``, ``conv_op``,
    ``rotary_op``, ``recurrent_gla_op``, ``gated_delta_op``) against fla's functions as shipped, outputs and every
    gradient: fla's drivers inside, so the same numbers (the SwiGLU-linear's GEMMs are torch's own on both sides).
    And torch's checks of each op's registration (schema, autograd, fake against real)."""
    import fla.modules.activations.ops as fla_act
    import fla.modules.causal_conv1d.ops as fla_conv
    import fla.modules.norm.fused_norm_gate as fla_gate
    import fla.modules.norm.layernorm as fla_norm
    import fla.modules.rotary.ops as fla_rotary
    import fla.ops.gated_delta_rule as fla_delta
    import fla.ops.gla as fla_gla

    from titan_ext.kernels import conv_op, elementwise_ops, gated_delta_op, norm_ops, recurrent_gla_op, rotary_op

    ident = lambda x: x  # noqa: E731
    worst = {}
    x, r, g, w, b = leaves(((2, 9, 32), ident), ((2, 9, 32), ident), ((2, 9, 32), ident), ((32,), lambda x: 1 + x / 4),
                           ((32,), ident))
    prenorm = dict(eps=1e-6, prenorm=True, residual_in_fp32=True)
    worst["op_rms_norm"] = max(
        compare(lambda *a: fla_norm.rms_norm(a[0], a[1], None, residual=a[2], **prenorm),
                lambda *a: norm_ops.rms_norm(a[0], a[1], None, residual=a[2], **prenorm), [x, w, r]),
        compare(lambda *a: fla_norm.rms_norm(*a), lambda *a: norm_ops.rms_norm(*a), [x, w, b]))
    worst["op_rms_norm_gated"] = compare(
        lambda *a: fla_gate.rms_norm_gated(a[0], a[1], a[2], None, activation="swish", eps=1e-6),
        lambda *a: norm_ops.rms_norm_gated(a[0], a[1], a[2], None, activation="swish", eps=1e-6), [x, g, w])
    down = leaves(((16, 32), ident), ((16,), ident))
    worst["op_swiglu_linear"] = compare(fla_act.swiglu_linear, elementwise_ops.swiglu_linear, [x, g, *down])

    conv_w, conv_b = leaves(((32, 4), lambda t: t / 2), ((32,), ident))
    worst["op_causal_conv1d"] = max(compare(
        lambda *a, **kw: fla_conv.causal_conv1d(a[0][:1], weight=a[1], bias=a[2], **kw),
        lambda *a, **kw: conv_op.causal_conv1d(a[0][:1], weight=a[1], bias=a[2], **kw),
        [x, conv_w, conv_b], activation="silu", cu_seqlens=torch.tensor([0, 4, 9]), **states)
        for states in ({}, {"output_final_state": True}))

    q, k = leaves(((2, 9, 2, 16), ident), ((2, 9, 2, 16), ident))
    angles = torch.outer(torch.arange(12.0), torch.rand(8, generator=torch.Generator().manual_seed(3)))
    worst["op_rotary_embedding"] = max(
        compare(lambda a: fla_rotary.rotary_embedding(a, angles.cos(), angles.sin(), seqlen_offsets=2),
                lambda a: rotary_op.rotary_embedding(a, angles.cos(), angles.sin(), seqlen_offsets=2), [q]),
        compare(lambda a: fla_rotary.rotary_embedding(a[:1], angles.cos(), angles.sin(), cu_seqlens=torch.tensor([0, 4, 9])),
                lambda a: rotary_op.rotary_embedding(a[:1], angles.cos(), angles.sin(), cu_seqlens=torch.tensor([0, 4, 9])),
                [k]))

    gla = gla_inputs(1, states=2)
    worst["op_fused_recurrent_gla"] = compare(
        lambda *a, **kw: fla_gla.fused_recurrent_gla(*a[:3], gk=a[3], initial_state=a[4], **kw),
        lambda *a, **kw: recurrent_gla_op.fused_recurrent_gla(*a[:3], gk=a[3], initial_state=a[4], **kw),
        gla, output_final_state=True, cu_seqlens=CU)

    B, H, K, V = 1, 2, 16, 16
    dq, dk, dv, raw_g, beta, A_log, dt_bias, h0 = leaves(
        ((B, T, H, K), ident), ((B, T, H, K), ident), ((B, T, H, V), ident), ((B, T, H), ident), ((B, T, H), ident),
        ((H,), lambda t: t / 4), ((H,), ident), ((2, H, V, K), lambda t: t / 4))
    mixer = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 state_v_first=True, cu_seqlens=CU, use_gate_in_kernel=True)  # as fla's GatedDeltaNet calls it
    worst["op_chunk_gated_delta_rule"] = compare(
        lambda *a, **kw: fla_delta.chunk_gated_delta_rule(*a[:5], A_log=a[5], dt_bias=a[6], initial_state=a[7], **kw),
        lambda *a, **kw: gated_delta_op.chunk_gated_delta_rule(*a[:5], A_log=a[5], dt_bias=a[6], initial_state=a[7], **kw),
        [dq, dk, dv, raw_g, beta, A_log, dt_bias, h0], **mixer)
    # q, k, v as fla's fused q/k/v convolution leaves them (strided views of one tensor), g and beta likewise:
    # the op's backward must read the contiguous copies fla's input_guard makes (whole Gated DeltaNet models
    # under CP=2 and TP=2 disagreed with one process while it read the views)
    fused, gates = leaves(((B, T, H, 2 * K + V), ident), ((B, T, H, 2), ident))
    views = lambda fn: lambda x, gb, *a, **kw: fn(  # noqa: E731
        *x.split((K, K, V), dim=-1), gb[..., 0], gb[..., 1], A_log=a[0], dt_bias=a[1], initial_state=a[2], **kw)
    worst["op_chunk_gated_delta_rule_strided"] = compare(
        views(fla_delta.chunk_gated_delta_rule), views(gated_delta_op.chunk_gated_delta_rule),
        [fused, gates, A_log, dt_bias, h0], **mixer)

    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    op_calls = {
        "rms_norm_fwd": (x, g, w, None, r, 1e-6, True, "swish"),
        "swiglu_fwd": (x, g),
        "causal_conv1d_fwd": (x, conv_w, conv_b, None, None, True, "silu", None, None),
        "rotary_embedding": (q, angles.cos(), angles.sin(), 1, None, None, False, False),
        "fused_recurrent_gla_fwd": (*gla[:4], None, 0.25, gla[4], True, False, False, CU),
        "chunk_gated_delta_rule_fwd": (dq, dk, dv, raw_g, beta, A_log, dt_bias, 0.25, h0, True, True, True, True, False,
                                       True, CU, None, 64),
    }
    for op, args in op_calls.items():
        result = torch.library.opcheck(getattr(torch.ops.titan_ext, op).default, args, test_utils=checks)
        assert set(result.values()) == {"SUCCESS"}, (op, result)
    return worst


def case_causal_conv1d(packed: bool):
    from fla.modules.causal_conv1d.ops import causal_conv1d as shipped

    from titan_ext.kernels.conv import causal_conv1d as ours

    D, W = 32, 4
    x, weight, bias = leaves(((1 if packed else 2, T, D), lambda x: x), ((D, W), lambda x: x / 2), ((D,), lambda x: x))
    return compare(lambda *a, **kw: shipped(a[0], weight=a[1], bias=a[2], **kw)[0],
                   lambda *a, **kw: ours(a[0], weight=a[1], bias=a[2], **kw)[0],
                   [x, weight, bias], activation="silu", cu_seqlens=CU if packed else None)


def case_norms():
    from fla.modules.norm import layernorm, fused_norm_gate

    from titan_ext.kernels import norms

    x, g, w = leaves(((2, T, 32), lambda x: x), ((2, T, 32), lambda x: x), ((32,), lambda x: 1 + x / 4))
    plain = compare(lambda a, b: layernorm.rms_norm(a, b, None, eps=1e-6), lambda a, b: norms.rms_norm(a, b, None, eps=1e-6), [x, w])
    gated = compare(lambda a, b, c: fused_norm_gate.rms_norm_gated(a, b, c, None, activation="swish", eps=1e-6),
                    lambda a, b, c: norms.rms_norm_gated(a, b, c, None, activation="swish", eps=1e-6), [x, g, w])
    return max(plain, gated)


def tiny_args(name: str, **fields):
    """A debug flavor cut to a few milliseconds per interpreted kernel: 1 layer, hidden 64."""
    if name == "gla":
        from titan_ext.models.gla import gla_flavors as flavors
    elif name == "kda":
        from titan_ext.models.kda import kda_flavors as flavors
    else:
        from titan_ext.models.gated_deltanet import gated_deltanet_flavors as flavors
    args = copy.deepcopy(flavors["debugmodel"])
    args.config.update(num_hidden_layers=1, vocab_size=256, hidden_size=64, num_heads=2, **fields)
    return args


def built(args, path: str, like=None):
    from titan_ext.models.adapter import build_model

    args = copy.deepcopy(args)
    args.kernel_path = path
    torch.manual_seed(0)
    model = build_model(args)
    if like is None:
        model.init_weights()
    else:
        model.load_state_dict(like.state_dict())
    return model


def _cp_rank(rank, mesh, names=("gla", "gated_deltanet")):
    """One of two gloo ranks: GLA (short convolutions), Gated DeltaNet and KDA under CP=2 on fla's kernels."""
    from helpers import plan_forward

    from titan_ext.job_plan import CPChoice
    from titan_ext.kernels.state_passing import piece_order
    from titan_ext.parallel.context_parallel import apply_cp

    patching.apply_once(kernel_patches.INTERPRETER)  # a forkserver child imports afresh
    worst = {}
    for name in names:
        args = tiny_args(name, **({"use_short_conv": True} if name == "gla" else {}))
        whole = built(args, "fla")
        model = built(args, "fla", like=whole)
        choice = CPChoice(2, 2)  # head-tail pieces: two per rank
        apply_cp(model, mesh, choice, plan_forward(model, cp=choice, cp_mesh=mesh).cp_layout)
        tokens = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(1))
        size = 64 // 4
        mine = torch.cat([torch.arange(p * size, (p + 1) * size) for p in piece_order(rank, 2, 2)])
        whole(tokens).float().sum().backward()
        out = model(tokens[:, mine], positions=torch.arange(64).expand(1, 64)[:, mine])
        out.float().sum().backward()
        grads = []
        for p, q in zip(model.parameters(), whole.parameters()):
            grad = p.grad.clone()
            torch.distributed.all_reduce(grad)
            grads.append(rel(grad, q.grad))
        with torch.no_grad():
            forward = rel(out, whole(tokens)[:, mine])
        worst[name] = max(forward, *grads)
    return worst


def _tp_rank(rank, mesh, name="gated_deltanet"):
    """One of two gloo ranks: Gated DeltaNet or KDA sharded by its TP plan, on fla's kernels (tp_local wrappers)."""
    from model_plans import TPOptions, apply_tp

    from titan_ext.parallel.tensor_parallel import tp_plan_class

    patching.apply_once(kernel_patches.INTERPRETER)
    args = tiny_args(name)
    whole = built(args, "fla")
    model = built(args, "fla", like=whole)
    apply_tp(model, mesh, tp_plan_class(model, 2)(TPOptions(sequence_parallel=True, loss_parallel=False)))
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    whole(tokens).float().sum().backward()
    out = model(tokens)
    out = out.full_tensor() if hasattr(out, "full_tensor") else out
    out.float().sum().backward()
    worst = rel(out.detach(), whole(tokens).detach())
    for (name, p), q in zip(model.named_parameters(), whole.parameters()):
        if p.grad is None and q.grad is None:  # unused by this forward on both sides
            continue
        if p.grad is None or q.grad is None:
            raise AssertionError(f"{name}: a gradient on one side only (TP {p.grad is not None}, one process {q.grad is not None})")
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        worst = max(worst, rel(grad, q.grad))
    return worst


def case_cp():
    from helpers import on_forked_ranks

    results = on_forked_ranks(2, _cp_rank)
    return {f"cp2_{name}": max(r[name] for r in results.values()) for name in results[0]}


def case_tp(name="gated_deltanet"):
    import functools

    from helpers import on_forked_ranks

    return {f"tp2_{name}": max(on_forked_ranks(2, functools.partial(_tp_rank, name=name)).values())}


def case_cp_kda():
    import functools

    from helpers import on_forked_ranks

    results = on_forked_ranks(2, functools.partial(_cp_rank, names=("kda",)))
    return {"cp2_kda": max(r["kda"] for r in results.values())}


def packed_documents_on_both_paths(args) -> float:
    """A whole model on fla's kernels vs titan_ext's portable ones, two rows of two packed documents each:
    the worst relative difference of its logits and every gradient."""
    ours = built(args, "portable")
    theirs = built(args, "fla", like=ours)
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(48).expand(2, 48).clone()
    positions[:, 20:] -= 20  # a second document from token 20
    outs = [model(tokens, document_positions=positions) for model in (ours, theirs)]
    for out in outs:
        out.float().sum().backward()
    grads = [rel(p.grad, q.grad) for p, q in zip(theirs.parameters(), ours.parameters())]
    return max(rel(outs[1].detach(), outs[0].detach()), *grads)


def case_transformers_gated_deltanet():
    """Qwen3.5's Gated DeltaNet layer (titan_ext's forward) on fla's kernels vs titan_ext's portable ones, with
    packed documents (the convolution and the delta rule restart at ``cu_seq_lens_q``)."""
    from titan_ext.models.args import transformers_model

    args = transformers_model("qwen3_5_text", vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                              layer_types=["linear_attention"])
    return packed_documents_on_both_paths(args)


def case_gla_hybrid():
    """fla's GLA hybrid (GLA at layer 0, fla's softmax Attention at layer 1 by fla's ``attn`` config) on fla's
    kernels vs titan_ext's portable ones, with packed documents: the whole model, as a hybrid trains."""
    args = tiny_args("gla", attn={"layers": [1], "num_heads": 2, "num_kv_heads": 1})
    args.config["num_hidden_layers"] = 2
    return packed_documents_on_both_paths(args)


def case_compiled_blocks():
    """Blocks on the fla path compiled as titan_ext compiles them (pure GLA; the GLA hybrid: GLA and fla's softmax
    Attention; Gated DeltaNet; KDA with its short convolutions), two steps without a recompile: no graph break,
    one graph per block kind (every fla kernel a block reaches runs as a torch op: ``kernels.*_op``), and dynamo
    compiles titan_ext's and fla's layer and module code only, never a frame inside fla's kernel functions or
    Triton (traced, they broke the graph deep inside fla, and dynamo compiled fla's wrappers and Triton's
    launcher as frames of their own); compiled against eager."""
    from torch._dynamo.convert_frame import register_bytecode_hook
    from torch._dynamo.utils import counters

    from titan_ext.parallel.compile import apply_compile

    hybrid = tiny_args("gla", attn={"layers": [1], "num_heads": 2, "num_kv_heads": 1})
    hybrid.config["num_hidden_layers"] = 3  # GLA, attention, GLA: the third block reuses the first's frames
    # (name, args, graphs, graph breaks, as counted): one graph per block kind, no break
    models = (("gla", tiny_args("gla"), 1, 0), ("gla_hybrid", hybrid, 2, 0),
              ("gated_deltanet", tiny_args("gated_deltanet"), 1, 0), ("kda", tiny_args("kda"), 1, 0))
    worst = {}
    for name, args, kinds, expected_breaks in models:  # kinds: graphs expected
        eager = built(args, "fla")
        compiled = built(args, "fla", like=eager)
        apply_compile(compiled, "aot_eager")
        frames = []
        hook = register_bytecode_hook(lambda code, new_code: frames.append(code))
        torch._dynamo.reset()
        counters.clear()
        try:
            tokens = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(1))
            with torch._dynamo.config.patch(error_on_recompile=True):
                outs = [model(tokens) for model in (eager, compiled)]
                for out in outs:
                    out.float().sum().backward()
                grads = [rel(p.grad, q.grad) for p, q in zip(compiled.parameters(), eager.parameters())]
                compiled(tokens).float().sum().backward()  # step 2: filled caches, the same frames
        finally:
            hook.remove()
        breaks, graphs = dict(counters["graph_break"]), counters["stats"]["unique_graphs"]
        if sum(breaks.values()) != expected_breaks or graphs != kinds:
            raise AssertionError(f"{name}: {sum(breaks.values())} graph breaks, {graphs} graphs for {kinds} block "
                                 f"kind(s): {[reason[:200] for reason in breaks]}")
        inside = sorted({f"{c.co_filename.split('site-packages/')[-1]}:{c.co_name}" for c in frames
                         if "/triton/" in c.co_filename or "/fla/ops/" in c.co_filename or "/fla/utils/" in c.co_filename
                         or "/fla/modules/norm/" in c.co_filename or "/fla/modules/rotary/" in c.co_filename
                         or "/fla/modules/causal_conv1d/" in c.co_filename
                         or ("/fla/modules/" in c.co_filename and "forward" not in c.co_name)})
        if inside or not frames:
            raise AssertionError(f"{name}: dynamo compiled frames inside fla's kernels or Triton: {inside}" if inside
                                 else f"{name}: dynamo compiled no frame: the blocks did not run compiled")
        worst[f"compiled_blocks_{name}"] = max(rel(outs[1].detach(), outs[0].detach()), *grads)
    return worst


CASES = {
    "chunk_gla": (lambda: case_chunk_gla(False), 1e-4),
    "chunk_gla_packed": (lambda: case_chunk_gla(True), 1e-4),
    "fused_recurrent_gla": (lambda: case_fused_recurrent_gla(False), 1e-4),
    "fused_recurrent_gla_packed": (lambda: case_fused_recurrent_gla(True), 1e-4),
    "chunk_gated_delta_rule": (lambda: case_gated_delta_rule("chunk_gated_delta_rule", False), 1e-4),
    "chunk_gated_delta_rule_packed": (lambda: case_gated_delta_rule("chunk_gated_delta_rule", True), 1e-4),
    "fused_recurrent_gated_delta_rule": (lambda: case_gated_delta_rule("fused_recurrent_gated_delta_rule", False), 1e-4),
    "chunk_kda_packed": (lambda: case_kda("chunk_kda", True), 1e-4),
    "fused_recurrent_kda": (lambda: case_kda("fused_recurrent_kda", False), 1e-4),
    "causal_conv1d": (lambda: case_causal_conv1d(False), 1e-4),
    "causal_conv1d_packed": (lambda: case_causal_conv1d(True), 1e-4),
    "rms_norms": (case_norms, 1e-4),
    "cp": (case_cp, 1e-4),
    "tp": (case_tp, 1e-4),
    "gla_hybrid": (case_gla_hybrid, 1e-4),  # the whole hybrid model, with documents (~7 s)
    "compiled_blocks": (case_compiled_blocks, 1e-4),
    "block_ops": (case_block_ops, 0.0),  # fla's drivers inside: bit for bit
    "kda_op": (case_kda_op, 0.0),  # the same kernels on the same inputs: bit for bit
}
OPT_IN = {
    "chunk_kda": (lambda: case_kda("chunk_kda", False), 1e-4),
    "cp_kda": (case_cp_kda, 1e-4),
    "tp_kda": (lambda: case_tp("kda"), 1e-4),
    "kimi_kda": (case_kimi_kda, 1e-4),
    "transformers_gated_deltanet": (case_transformers_gated_deltanet, 1e-4),
}
"""Run by name only (fla's KDA kernels are the interpreter's slowest: ~40 s, ~130 s and ~140 s on the shared
2-core machine): KDA unpacked (the packed case covers states and gradients), CP=2 and TP=2 on fla's KDA,
Kimi Linear's call with documents on fla's kernel, and Qwen3.5's Gated DeltaNet layer on fla's kernels."""


def main(names) -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 (before fla is imported)", file=sys.stderr)
        return 2
    for name in names or CASES:
        fn, tol = {**CASES, **OPT_IN}[name]
        start = time.time()
        try:
            worst = fn()
        except Exception as error:  # noqa: BLE001  (reported per case)
            print(json.dumps({"case": name, "error": f"{type(error).__name__}: {error}"}), flush=True)
            continue
        for case, value in (worst.items() if isinstance(worst, dict) else [(name, worst)]):
            print(json.dumps({"case": case, "worst": value, "tol": tol, "seconds": round(time.time() - start, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
