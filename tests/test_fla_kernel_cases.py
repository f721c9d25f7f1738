"""fla's own kernel test cases, run against titan_ext's portable kernels with fla's references and tolerances.

The cases are those of flash-linear-attention's tests (``tests/ops/test_gla.py``, ``test_gdn.py``,
``test_kda.py``, ``test_simple_gla.py``, ``test_linear_attn.py``, ``test_delta.py``, ``test_retention.py``,
``test_lightning_attn.py``; ``tests/modules/test_conv.py``, ``test_layernorm.py``, ``test_layernorm_gated.py``,
``test_activation.py``, ``test_rotary.py``, ``test_cross_entropy.py``): what each compares (outputs, final
states and every gradient, against the same cotangents), fla's per-quantity tolerance (``fla_close``: fla's
``assert_close`` metric, RMS error over RMS reference, without its CI leniency), and the arguments each case
varies (initial and final states, varlen ``cu_seqlens``, ``scale``, q/k L2 norm, the gate and beta's sigmoid in
the kernel, grouped value heads, ``state_v_first``, ``chunk_size``, ``reverse``, ``normalize``). The references
are fla's pure-torch ones shipped in the wheel (``fla.ops.*.naive``, ``rotary_embedding_ref``,
``naive_gdn_gate``, ``naive_kda_gate``), or plain torch where fla's test writes its own (the convolution, the
norms, activations and losses). Shapes are cut to CPU size (T <= 130, head dims 8-32) and run in fp32: fla's
fp16 rows would test fla's Triton rounding, not the math. Where fla's test compares two of its Triton kernels
(``chunk`` against ``fused_recurrent``), the portable one is compared with the naive reference instead.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fla.ops.delta_rule.naive import delta_rule_recurrence
from fla.ops.gated_delta_rule.gate import naive_gdn_gate
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
from fla.ops.gla.naive import naive_recurrent_gla
from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
from fla.ops.kda.naive import naive_recurrent_kda
from fla.ops.linear_attn.naive import naive_recurrent_linear_attn
from fla.ops.retention.naive import naive_retention
from fla.ops.simple_gla.naive import naive_parallel_simple_gla, naive_recurrent_simple_gla

from titan_ext import kernels
from titan_ext.kernels import activations, conv, delta_rule, gla, gla_op, losses, norms, rotary, simple_gla
from titan_ext.kernels.gated_delta import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from titan_ext.kernels.kda import chunk_kda, fused_recurrent_kda


def fla_close(name, ref, tri, ratio, err_atol=1e-6):
    """fla's ``assert_close``: passes when the largest absolute error is at most ``err_atol``, else when the RMS
    error over the reference's RMS is below ``ratio`` (fla relaxes this on its CI machines; here it is strict)."""
    assert ref.shape == tri.shape, f"{name}: shape {tuple(tri.shape)} != {tuple(ref.shape)}"
    diff = (ref.detach().double() - tri.detach().double()).flatten()
    if diff.abs().max().item() <= err_atol:
        return
    rate = diff.square().mean().sqrt().item() / (ref.detach().double().flatten().square().mean().sqrt().item() + 1e-8)
    assert rate < ratio, f"{name}: error ratio {rate:.2e} >= {ratio}"


def outputs_and_grads(fn, inputs: dict, cotangents: list):
    """``fn(**inputs)`` -> its outputs (``o`` and, where returned, the final state) and ``d<name>`` for every
    tensor input that requires grad, against ``cotangents`` (one per output)."""
    leaves = {k: (v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v)
              for k, v in inputs.items()}
    out = fn(**leaves)
    out = [out] if isinstance(out, torch.Tensor) else [o for o in out if o is not None]
    loss = sum((o * c).sum() for o, c in zip(out, cotangents))
    grads = [k for k, v in leaves.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    found = torch.autograd.grad(loss, [leaves[k] for k in grads], allow_unused=True)
    return out, {f"d{k}": (torch.zeros_like(leaves[k]) if g is None else g) for k, g in zip(grads, found)}


def compare(ref, tri, tolerances: dict, state_layout=lambda s: s):
    """``ref``/``tri``: ``outputs_and_grads`` results; ``tolerances``: name -> fla's ratio (``o``, ``ht``, ``d*``)."""
    (ref_out, ref_grads), (tri_out, tri_grads) = ref, tri
    fla_close("o", ref_out[0], tri_out[0], tolerances["o"])
    if "ht" in tolerances:
        fla_close("ht", ref_out[1], state_layout(tri_out[1]), tolerances["ht"])
    for name, ratio in tolerances.items():
        if name.startswith("d") and name in ref_grads:  # a case without that input (e.g. no dt_bias) skips it
            tri_grad = state_layout(tri_grads[name]) if name == "dh0" else tri_grads[name]
            fla_close(name, ref_grads[name], tri_grad, ratio, err_atol=2e-4 if name == "dg" else 1e-6)


def cotangents_for(v_shape, state_shape):
    return [torch.randn(v_shape), torch.randn(state_shape)]


def each_sequence(reference, cu_seqlens, inputs: dict, h0, sequence_keys):
    """A reference without varlen run on each packed sequence (``[1, T, ...]`` slices of ``sequence_keys``) from
    its own initial state; outputs concatenated, final states stacked."""
    outs, states = [], []
    bounds = cu_seqlens.tolist()
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        piece = {k: (v[:, bos:eos] if k in sequence_keys else v) for k, v in inputs.items()}
        o, ht = reference(**piece, initial_state=None if h0 is None else h0[n : n + 1])
        outs.append(o)
        states.append(ht)
    return torch.cat(outs, 1), torch.cat(states, 0)


GRAD_TOL = dict(o=0.005, ht=0.005, dq=0.005, dk=0.005, dv=0.005, dg=0.005, dh0=0.005)

# --- GLA (tests/ops/test_gla.py) ---------------------------------------------------------------------------


def gla_case(B, T, H, D, gate_logit_normalizer):
    torch.manual_seed(42)
    g = F.logsigmoid(torch.rand(B, T, H, D)) / gate_logit_normalizer
    return dict(q=torch.rand(B, T, H, D), k=torch.rand(B, T, H, D), v=torch.rand(B, T, H, D), g=g,
                h0=torch.rand(B, H, D, D))


def naive_gla(q, k, v, g, initial_state):
    return naive_recurrent_gla(q, k, v, g, initial_state=initial_state, output_final_state=True)


@pytest.mark.parametrize("kernel", ["fused_recurrent", "chunk"])
@pytest.mark.parametrize(("B", "T", "H", "D", "gate_logit_normalizer"),
                         [(1, 63, 1, 16, 1), (2, 100, 2, 12, 0.1), (2, 80, 2, 16, 10)])
def test_gla(kernel, B, T, H, D, gate_logit_normalizer):
    x = {**gla_case(B, T, H, D, gate_logit_normalizer)}
    x = {k: v.requires_grad_() for k, v in x.items()}
    cot = cotangents_for((B, T, H, D), (B, H, D, D))
    ref = outputs_and_grads(lambda q, k, v, g, h0: naive_gla(q, k, v, g, h0), x, cot)
    if kernel == "chunk":  # the op the portable path binds for chunk_gla (titan_ext::chunk_gla_fwd/bwd)
        fn = lambda q, k, v, g, h0: gla_op.portable_chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True)  # noqa: E731
        tol = {**GRAD_TOL, "o": 0.004}
    else:
        fn = lambda q, k, v, g, h0: gla.fused_recurrent_gla(q, k, v, gk=g, initial_state=h0, output_final_state=True)  # noqa: E731
        tol = GRAD_TOL
    compare(ref, outputs_and_grads(fn, x, cot), tol)


@pytest.mark.parametrize("kernel", ["fused_recurrent", "chunk"])
def test_gla_state_v_first(kernel):
    x = {k: v.requires_grad_() for k, v in gla_case(2, 70, 2, 16, 1).items()}
    x["v"] = x["v"][..., :8].detach().requires_grad_()  # K != V: the layouts differ
    x["h0"] = x["h0"][..., :8].detach().requires_grad_()
    cot = cotangents_for((2, 70, 2, 8), (2, 2, 16, 8))
    call = gla_op.portable_chunk_gla if kernel == "chunk" else gla.fused_recurrent_gla

    def run(v_first):
        def fn(q, k, v, g, h0):
            h = h0.transpose(-1, -2).contiguous() if v_first else h0
            o, ht = call(q, k, v, g, initial_state=h, output_final_state=True, state_v_first=v_first)
            return o, (ht.transpose(-1, -2) if v_first else ht)
        return outputs_and_grads(fn, x, cot)

    compare(run(False), run(True), GRAD_TOL)


@pytest.mark.parametrize("kernel", ["fused_recurrent", "chunk"])
@pytest.mark.parametrize("cu_seqlens", [[0, 15], [0, 0, 16], [0, 40, 70, 130]])
def test_gla_varlen(kernel, cu_seqlens):
    torch.manual_seed(42)
    N, T, H, D = len(cu_seqlens) - 1, cu_seqlens[-1], 2, 16
    x = dict(q=torch.rand(1, T, H, D), k=torch.rand(1, T, H, D), v=torch.rand(1, T, H, D),
             g=F.logsigmoid(torch.rand(1, T, H, D)), h0=torch.rand(N, H, D, D))
    x = {k: v.requires_grad_() for k, v in x.items()}
    cu = torch.tensor(cu_seqlens)
    cot = [torch.randn(1, T, H, D), torch.rand(N, H, D, D)]
    ref = outputs_and_grads(lambda h0, **s: each_sequence(naive_gla, cu, s, h0, "qkvg"), x, cot)
    call = gla_op.portable_chunk_gla if kernel == "chunk" else gla.fused_recurrent_gla
    tri = outputs_and_grads(lambda q, k, v, g, h0: call(q, k, v, g, initial_state=h0, output_final_state=True,
                                                         cu_seqlens=cu), x, cot)
    compare(ref, tri, {**GRAD_TOL, "o": 0.004})


# --- Gated DeltaNet (tests/ops/test_gdn.py) ----------------------------------------------------------------

GDN_TOL = dict(o=0.005, ht=0.005, dq=0.008, dk=0.008, dv=0.008, dbeta=0.02, dg=0.02, dh0=0.008)


def gdn_case(B, T, H, HV, D, gate_logit_normalizer=1.0, mask_p=0.0, h0=torch.randn):
    torch.manual_seed(42)
    g = F.logsigmoid(torch.rand(B, T, HV)) / gate_logit_normalizer
    g = g * (torch.rand_like(g) > mask_p)
    return dict(q=torch.rand(B, T, H, D), k=torch.rand(B, T, H, D), v=torch.rand(B, T, HV, D), g=g,
                beta=torch.rand(B, T, HV).sigmoid(), h0=h0(B, HV, D, D))


def naive_gdn(q, k, v, g, beta, initial_state, scale=None, l2norm=True):
    """fla's reference with fla's test's preparation: q/k normalised and repeated over grouped value heads."""
    G = v.shape[2] // q.shape[2]
    q, k = (x.repeat_interleave(G, dim=2) for x in (q, k))
    if l2norm:
        q, k = F.normalize(q, p=2, dim=-1), F.normalize(k, p=2, dim=-1)
    return naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale=scale, initial_state=initial_state,
                                            output_final_state=True)


@pytest.mark.parametrize(("B", "T", "H", "HV", "D", "scale", "gate_logit_normalizer", "mask_p", "l2norm_in_kernel"), [
    (2, 75, 2, 2, 16, 1, 0.01, 0, False),
    (2, 100, 2, 4, 16, 0.1, 1, 0.5, True),
    (1, 63, 1, 1, 24, 1, 1, 0, False),
    (2, 70, 2, 2, 16, 0.1, 10, 0, True),
])
def test_gdn_chunk(B, T, H, HV, D, scale, gate_logit_normalizer, mask_p, l2norm_in_kernel):
    x = {k: v.requires_grad_() for k, v in gdn_case(B, T, H, HV, D, gate_logit_normalizer, mask_p, torch.zeros).items()}
    cot = cotangents_for((B, T, HV, D), (B, HV, D, D))
    ref = outputs_and_grads(lambda q, k, v, g, beta, h0: naive_gdn(q, k, v, g, beta, h0, scale), x, cot)

    def tri(q, k, v, g, beta, h0):
        if not l2norm_in_kernel:
            q, k = F.normalize(q, p=2, dim=-1), F.normalize(k, p=2, dim=-1)
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=l2norm_in_kernel)

    compare(ref, outputs_and_grads(tri, x, cot), GDN_TOL)


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_gdn_chunk_with_chunk_size(chunk_size):
    x = {k: v.requires_grad_() for k, v in gdn_case(1, 64, 2, 4, 16, h0=torch.randn).items()}
    cot = cotangents_for((1, 64, 4, 16), (1, 4, 16, 16))
    ref = outputs_and_grads(lambda q, k, v, g, beta, h0: naive_gdn(q, k, v, g, beta, h0, 0.1), x, cot)
    tri = outputs_and_grads(lambda q, k, v, g, beta, h0: chunk_gated_delta_rule(
        q, k, v, g, beta, scale=0.1, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
        chunk_size=chunk_size), x, cot)
    compare(ref, tri, dict(o=0.005, ht=0.005, dq=0.005, dk=0.005, dv=0.005, dbeta=0.01, dg=0.01, dh0=0.005))


@pytest.mark.parametrize(("H", "HV", "l2norm", "allow_neg_eigval"), [(2, 2, False, False), (2, 4, True, True)])
def test_gdn_chunk_beta_sigmoid_in_kernel(H, HV, l2norm, allow_neg_eigval):
    x = {k: v.requires_grad_() for k, v in gdn_case(2, 70, H, HV, 16).items()}
    x["beta"] = torch.randn(2, 70, HV).requires_grad_()  # raw logits
    cot = cotangents_for((2, 70, HV, 16), (2, HV, 16, 16))
    ref = outputs_and_grads(lambda q, k, v, g, beta, h0: naive_gdn(
        q, k, v, g, beta.sigmoid() * (2 if allow_neg_eigval else 1), h0, 0.1), x, cot)

    def tri(q, k, v, g, beta, h0):
        if not l2norm:
            q, k = F.normalize(q, p=2, dim=-1), F.normalize(k, p=2, dim=-1)
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=0.1, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=l2norm, use_beta_sigmoid_in_kernel=True,
                                      allow_neg_eigval=allow_neg_eigval)

    compare(ref, outputs_and_grads(tri, x, cot), dict(GDN_TOL, dg=0.008))


@pytest.mark.parametrize("kernel", ["chunk", "fused_recurrent"])
def test_gdn_state_v_first_and_its_deprecated_alias(kernel):
    x = {k: v.requires_grad_() for k, v in gdn_case(2, 70, 2, 2, 16).items()}
    x["v"] = x["v"][..., :8].detach().requires_grad_()
    x["h0"] = x["h0"][..., :8].detach().requires_grad_()
    cot = cotangents_for((2, 70, 2, 8), (2, 2, 16, 8))
    call = chunk_gated_delta_rule if kernel == "chunk" else (
        lambda q, k, v, g, beta, **kw: fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, **kw))

    def run(**layout):
        v_first = bool(layout)

        def fn(q, k, v, g, beta, h0):
            h = h0.transpose(-1, -2).contiguous() if v_first else h0
            o, ht = call(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, g, beta, scale=0.5, initial_state=h,
                         output_final_state=True, **layout)
            return o, (ht.transpose(-1, -2) if v_first else ht)
        return outputs_and_grads(fn, x, cot)

    tol = {name: 1e-4 for name in ("o", "ht", "dq", "dk", "dv", "dbeta", "dg", "dh0")}
    k_first = run()
    compare(k_first, run(state_v_first=True), tol)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        compare(k_first, run(transpose_state_layout=True), tol)
    with pytest.raises(ValueError, match="Cannot pass both"):
        call(*(x[n] for n in "qkv"), x["g"], x["beta"], state_v_first=True, transpose_state_layout=True)


@pytest.mark.parametrize(("B", "T", "H", "HV", "D", "scale", "gate_logit_normalizer"),
                         [(1, 63, 1, 1, 16, 1, 1), (2, 100, 2, 4, 16, 1, 0.1), (2, 70, 2, 2, 16, 0.1, 1)])
def test_gdn_fused_recurrent(B, T, H, HV, D, scale, gate_logit_normalizer):
    torch.manual_seed(42)
    q, k = torch.randn(B, T, H, D), torch.randn(B, T, H, D)
    v, beta = torch.randn(B, T, HV, D), torch.rand(B, T, HV).sigmoid()
    g = F.logsigmoid(torch.rand(B, T, HV)) / gate_logit_normalizer
    h0 = torch.randn(B, HV, D, D)
    ref, ref_ht = naive_gdn(q, k, v, g, beta, h0, scale)
    tri, tri_ht = fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, scale=scale, initial_state=h0,
                                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
    fla_close("o", ref, tri, 0.002)
    fla_close("ht", ref_ht, tri_ht, 0.002)


@pytest.mark.parametrize("kernel", ["chunk", "fused_recurrent"])
@pytest.mark.parametrize(("H", "HV", "has_dt_bias", "cu_seqlens"),
                         [(1, 1, False, None), (2, 4, True, None), (2, 2, True, [0, 15, 40, 100])])
def test_gdn_gate_in_kernel(kernel, H, HV, has_dt_bias, cu_seqlens):
    """fla's test_chunk_gate_in_kernel(_gqa, _varlen) and test_fused_recurrent_gate_in_kernel(_varlen): the raw gate
    against fla's naive_gdn_gate, gradients into A_log and dt_bias included."""
    torch.manual_seed(42)
    B, T = (2, 70) if cu_seqlens is None else (1, cu_seqlens[-1])
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    x = dict(q=torch.rand(B, T, H, 16), k=torch.rand(B, T, H, 16), v=torch.rand(B, T, HV, 16),
             g=torch.randn(B, T, HV), beta=torch.rand(B, T, HV).sigmoid(), h0=torch.randn(N, HV, 16, 16),
             A_log=torch.log(torch.empty(HV).uniform_(1, 16)))
    if has_dt_bias:
        x["dt_bias"] = torch.randn(HV)
    x = {k: v.requires_grad_() for k, v in x.items()}
    cot = cotangents_for((B, T, HV, 16), (N, HV, 16, 16))

    def ref_fn(q, k, v, g, beta, h0, A_log, dt_bias=None):
        reference = lambda q, k, v, g, beta, initial_state: naive_gdn(q, k, v, g, beta, initial_state, 0.25)  # noqa: E731
        inputs = dict(q=q, k=k, v=v, g=naive_gdn_gate(g, A_log, dt_bias), beta=beta)
        if cu is None:
            return reference(**inputs, initial_state=h0)
        return each_sequence(reference, cu, inputs, h0, ("q", "k", "v", "g", "beta"))

    def tri_fn(q, k, v, g, beta, h0, A_log, dt_bias=None):
        options = dict(scale=0.25, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                       use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu)
        if kernel == "chunk":
            return chunk_gated_delta_rule(q, k, v, g, beta, **options)
        return fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, **options)

    tol = dict(GDN_TOL, dA_log=0.02, ddt_bias=0.02) if kernel == "chunk" else dict(o=0.002, ht=0.002)
    compare(outputs_and_grads(ref_fn, x, cot), outputs_and_grads(tri_fn, x, cot), tol)


@pytest.mark.parametrize(("allow_neg_eigval", "HV"), [(False, 1), (True, 4)])
def test_gdn_fused_recurrent_beta_sigmoid_in_kernel(allow_neg_eigval, HV):
    torch.manual_seed(42)
    q, k, v = torch.randn(2, 40, 1 if HV == 1 else 2, 16), None, torch.randn(2, 40, HV, 16)
    k = torch.randn_like(q)
    beta, g, h0 = torch.randn(2, 40, HV), F.logsigmoid(torch.rand(2, 40, HV)), torch.randn(2, HV, 16, 16)
    ref = naive_gdn(q, k, v, g, beta.sigmoid() * (2 if allow_neg_eigval else 1), h0, 0.1)
    tri = fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, scale=0.1, initial_state=h0, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                           allow_neg_eigval=allow_neg_eigval)
    fla_close("o", ref[0], tri[0], 0.005)
    fla_close("ht", ref[1], tri[1], 0.005)


@pytest.mark.parametrize(("H", "HV", "mask_p", "cu_seqlens"),
                         [(2, 2, 0, [0, 15]), (2, 2, 0.5, [0, 40, 70, 130]), (2, 4, 0, [0, 1, 64, 65, 100])])
def test_gdn_chunk_varlen(H, HV, mask_p, cu_seqlens):
    torch.manual_seed(42)
    cu, T, N, D = torch.tensor(cu_seqlens), cu_seqlens[-1], len(cu_seqlens) - 1, 16
    g = F.logsigmoid(torch.rand(1, T, HV))
    x = dict(q=torch.randn(1, T, H, D), k=F.normalize(torch.randn(1, T, H, D), p=2, dim=-1),
             v=torch.randn(1, T, HV, D), g=g * (torch.rand_like(g) > mask_p), beta=torch.rand(1, T, HV).sigmoid(),
             h0=torch.randn(N, HV, D, D))
    x = {k: v.requires_grad_() for k, v in x.items()}
    cot = [torch.randn(1, T, HV, D), torch.rand(N, HV, D, D)]
    reference = lambda q, k, v, g, beta, initial_state: naive_gdn(q, k, v, g, beta, initial_state, l2norm=False)  # noqa: E731
    ref = outputs_and_grads(lambda h0, **s: each_sequence(reference, cu, s, h0, ("q", "k", "v", "g", "beta")), x, cot)
    tri = outputs_and_grads(lambda q, k, v, g, beta, h0: chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu), x, cot)
    compare(ref, tri, GDN_TOL)


def test_gdn_fused_recurrent_takes_gk_gv_and_per_value_beta():
    """fla's fused_recurrent_gated_delta_rule's other gates (``gk`` per key, ``gv`` per value) and a per-value
    beta: against a loop of the recurrence as fla's kernel writes it (fla ships no naive form of these)."""
    torch.manual_seed(42)
    B, T, H, K, V = 2, 20, 2, 8, 6
    q, k = torch.randn(B, T, H, K), F.normalize(torch.randn(B, T, H, K), dim=-1)
    v, g = torch.randn(B, T, H, V), F.logsigmoid(torch.randn(B, T, H))
    gk, gv = F.logsigmoid(torch.randn(B, T, H, K)), F.logsigmoid(torch.randn(B, T, H, V))
    beta, h0 = torch.rand(B, T, H, V), torch.randn(B, H, K, V)
    h, outs = h0.clone(), []
    for t in range(T):
        h = h * g[:, t].exp()[..., None, None] * gk[:, t].exp()[..., None] * gv[:, t].exp()[..., None, :]
        u = beta[:, t] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], h))
        h = h + k[:, t][..., None] * u[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * K ** -0.5, h))
    for kwargs, ref in [(dict(g=g, gk=gk, gv=gv, beta=beta), None), (dict(gk=gk, beta=beta[..., 0]), "gk")]:
        o, ht = fused_recurrent_gated_delta_rule(q, k, v, initial_state=h0, output_final_state=True, **kwargs)
        if ref is None:
            fla_close("o", torch.stack(outs, 1), o, 1e-5)
            fla_close("ht", h, ht, 1e-5)
        else:  # gk alone, beta per head: KDA's recurrence
            o_ref, ht_ref = naive_recurrent_kda(q, k, v, gk, beta[..., 0], initial_state=h0, output_final_state=True)
            fla_close("o", o_ref, o, 1e-5)
            fla_close("ht", ht_ref, ht, 1e-5)


# --- KDA (tests/ops/test_kda.py) ----------------------------------------------------------------------------

KDA_TOL = dict(o=0.005, ht=0.005, dq=0.008, dk=0.008, dv=0.008, dg=0.02, dbeta=0.02, dh0=0.008)


@pytest.mark.parametrize(
    ("B", "T", "H", "HV", "D", "scale", "gate_logit_normalizer", "mask_p", "l2norm_in_kernel", "gate_in_kernel",
     "safe_gate", "chunk_size"), [
        (1, 63, 1, 1, 16, 1, 1, 0, False, False, True, 64),
        (2, 70, 2, 2, 12, 0.1, 1, 0.5, False, False, False, 64),
        (2, 64, 2, 2, 16, 0.1, 10, 0, True, True, False, 64),
        (2, 60, 2, 4, 16, 0.1, 1, 0, False, True, True, 32),
        (2, 50, 1, 2, 16, 1, 0.1, 0, True, False, False, 32),
    ])
def test_kda_chunk(B, T, H, HV, D, scale, gate_logit_normalizer, mask_p, l2norm_in_kernel, gate_in_kernel, safe_gate,
                   chunk_size):
    torch.manual_seed(42)
    g = torch.randn(B, T, HV, D)
    x = dict(q=torch.rand(B, T, H, D), k=torch.rand(B, T, H, D), v=torch.rand(B, T, HV, D),
             beta=torch.randn(B, T, HV).sigmoid(), h0=torch.randn(B, HV, D, D))
    lower_bound = -5.0 if safe_gate else None
    if gate_in_kernel:
        x.update(g=g, A_log=torch.randn(HV), dt_bias=torch.randn(HV * D))
    else:
        g = F.logsigmoid(g) / gate_logit_normalizer
        g = g * (torch.rand_like(g) > mask_p)
        x["g"] = g.clamp(-5, 0) if safe_gate else g
    x = {k: v.requires_grad_() for k, v in x.items()}
    cot = cotangents_for((B, T, HV, D), (B, HV, D, D))

    def ref_fn(q, k, v, g, beta, h0, A_log=None, dt_bias=None):
        if gate_in_kernel:
            g = (naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound=lower_bound) if safe_gate
                 else naive_kda_gate(g, A_log, dt_bias))
        return naive_recurrent_kda(F.normalize(q, p=2, dim=-1), F.normalize(k, p=2, dim=-1), v, g, beta, scale=scale,
                                   initial_state=h0, output_final_state=True)

    def tri_fn(q, k, v, g, beta, h0, A_log=None, dt_bias=None):
        if not l2norm_in_kernel:
            q, k = F.normalize(q, p=2, dim=-1), F.normalize(k, p=2, dim=-1)
        return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                         use_qk_l2norm_in_kernel=l2norm_in_kernel, use_gate_in_kernel=gate_in_kernel,
                         safe_gate=safe_gate, lower_bound=lower_bound, disable_recompute=True, A_log=A_log,
                         dt_bias=dt_bias, chunk_size=chunk_size)

    tol = dict(KDA_TOL, dA_log=0.003, ddt_bias=0.008) if gate_in_kernel else KDA_TOL
    compare(outputs_and_grads(ref_fn, x, cot), outputs_and_grads(tri_fn, x, cot), tol)


@pytest.mark.parametrize(("H", "HV", "cu_seqlens"), [(2, 2, [0, 15]), (2, 4, [0, 30, 31, 90])])
def test_kda_chunk_varlen(H, HV, cu_seqlens):
    torch.manual_seed(42)
    cu, T, N, D = torch.tensor(cu_seqlens), cu_seqlens[-1], len(cu_seqlens) - 1, 16
    x = dict(q=torch.rand(1, T, H, D), k=torch.rand(1, T, H, D), v=torch.rand(1, T, HV, D),
             g=F.logsigmoid(torch.randn(1, T, HV, D)), beta=torch.rand(1, T, HV).sigmoid(), h0=torch.randn(N, HV, D, D))
    x = {k: v.requires_grad_() for k, v in x.items()}
    cot = [torch.randn(1, T, HV, D), torch.rand(N, HV, D, D)]

    def reference(q, k, v, g, beta, initial_state):
        return naive_recurrent_kda(F.normalize(q, p=2, dim=-1), F.normalize(k, p=2, dim=-1), v, g, beta,
                                   initial_state=initial_state, output_final_state=True)

    ref = outputs_and_grads(lambda h0, **s: each_sequence(reference, cu, s, h0, ("q", "k", "v", "g", "beta")), x, cot)
    tri = outputs_and_grads(lambda q, k, v, g, beta, h0: chunk_kda(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu),
        x, cot)
    compare(ref, tri, dict(o=0.005, ht=0.005, dq=0.007, dk=0.008, dv=0.007, dg=0.015, dbeta=0.015, dh0=0.007))


@pytest.mark.parametrize("kernel", ["chunk", "fused_recurrent"])
def test_kda_state_v_first(kernel):
    torch.manual_seed(42)
    x = dict(q=torch.rand(2, 40, 2, 16), k=torch.rand(2, 40, 2, 16), v=torch.rand(2, 40, 2, 8),
             g=F.logsigmoid(torch.randn(2, 40, 2, 16)), beta=torch.rand(2, 40, 2).sigmoid(), h0=torch.randn(2, 2, 16, 8))
    x = {k: v.requires_grad_() for k, v in x.items()}
    cot = cotangents_for((2, 40, 2, 8), (2, 2, 16, 8))
    call = chunk_kda if kernel == "chunk" else fused_recurrent_kda

    def run(v_first):
        def fn(q, k, v, g, beta, h0):
            h = h0.transpose(-1, -2).contiguous() if v_first else h0
            o, ht = call(q, k, v, g, beta, initial_state=h, output_final_state=True, use_qk_l2norm_in_kernel=True,
                         state_v_first=v_first)
            return o, (ht.transpose(-1, -2) if v_first else ht)
        return outputs_and_grads(fn, x, cot)

    compare(run(False), run(True), {name: 1e-4 for name in ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")})


@pytest.mark.parametrize(("HV", "has_dt_bias", "lower_bound", "beta_sigmoid", "cu_seqlens"), [
    (2, True, None, False, None), (4, False, -5.0, True, None), (2, True, None, True, [0, 7, 30])])
def test_kda_fused_recurrent(HV, has_dt_bias, lower_bound, beta_sigmoid, cu_seqlens):
    """fla's test_fused_recurrent, _gate_in_kernel and _use_beta_sigmoid_in_kernel: against naive_recurrent_kda
    with the gate (or lower-bounded gate) and sigmoid applied first."""
    torch.manual_seed(42)
    B, T = (2, 30) if cu_seqlens is None else (1, cu_seqlens[-1])
    N, H, D = (B if cu_seqlens is None else len(cu_seqlens) - 1), 2, 16
    q, k, v = torch.randn(B, T, H, D), torch.randn(B, T, H, D), torch.randn(B, T, HV, D)
    g, beta, h0 = torch.randn(B, T, HV, D), torch.randn(B, T, HV), torch.randn(N, HV, D, D)
    A_log, dt_bias = torch.randn(HV), (torch.randn(HV * D) if has_dt_bias else None)
    gate = (naive_kda_gate(g, A_log, dt_bias) if lower_bound is None
            else naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound=lower_bound))
    beta_ref = beta.sigmoid() if beta_sigmoid else beta.sigmoid()
    beta_in = beta if beta_sigmoid else beta.sigmoid()
    G = HV // H

    def reference(q, k, v, g, beta, initial_state):
        q, k = (F.normalize(x.repeat_interleave(G, dim=2), p=2, dim=-1) for x in (q, k))
        return naive_recurrent_kda(q, k, v, g, beta, scale=0.5, initial_state=initial_state, output_final_state=True)

    inputs = dict(q=q, k=k, v=v, g=gate, beta=beta_ref)
    ref = reference(**inputs, initial_state=h0) if cu_seqlens is None else each_sequence(
        reference, torch.tensor(cu_seqlens), inputs, h0, ("q", "k", "v", "g", "beta"))
    tri = fused_recurrent_kda(q, k, v, g, beta_in, A_log=A_log, dt_bias=dt_bias, scale=0.5, initial_state=h0,
                              output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                              use_beta_sigmoid_in_kernel=beta_sigmoid, lower_bound=lower_bound,
                              cu_seqlens=None if cu_seqlens is None else torch.tensor(cu_seqlens))
    fla_close("o", ref[0], tri[0], 0.002)
    fla_close("ht", ref[1], tri[1], 0.002)


# --- simple GLA, linear attention, lightning attention, retention, delta rule (tests/ops/test_*.py) -----------


def simple_gla_case(B, T, H, D, gate_logit_normalizer=1.0):
    torch.manual_seed(42)
    return dict(q=torch.randn(B, T, H, D), k=torch.randn(B, T, H, D), v=torch.randn(B, T, H, D),
                g=F.logsigmoid(torch.rand(B, T, H)) / gate_logit_normalizer, h0=torch.randn(B, H, D, D))


def naive_simple_gla(q, k, v, g, initial_state, scale=None):
    return naive_recurrent_simple_gla(q, k, v, g, scale=scale, initial_state=initial_state, output_final_state=True)


SIMPLE_GLA_KERNELS = {
    "chunk": lambda q, k, v, g, h0, **kw: simple_gla.chunk_simple_gla(q, k, v, g, initial_state=h0,
                                                                      output_final_state=True, **kw),
    "fused_chunk": lambda q, k, v, g, h0, **kw: simple_gla.fused_chunk_simple_gla(q, k, v, g, initial_state=h0,
                                                                                  output_final_state=True, **kw),
    "fused_recurrent": lambda q, k, v, g, h0, **kw: simple_gla.fused_recurrent_simple_gla(
        q, k, v, g, initial_state=h0, output_final_state=True, **kw),
}


@pytest.mark.parametrize("kernel", SIMPLE_GLA_KERNELS)
@pytest.mark.parametrize(("B", "T", "H", "D", "scale", "gate_logit_normalizer"),
                         [(1, 63, 1, 16, 1, 1), (2, 100, 2, 12, 0.1, 10)])
def test_simple_gla(kernel, B, T, H, D, scale, gate_logit_normalizer):
    x = {k: v.requires_grad_() for k, v in simple_gla_case(B, T, H, D, gate_logit_normalizer).items()}
    cot = cotangents_for((B, T, H, D), (B, H, D, D))
    ref = outputs_and_grads(lambda q, k, v, g, h0: naive_simple_gla(q, k, v, g, h0, scale), x, cot)
    tri = outputs_and_grads(lambda **a: SIMPLE_GLA_KERNELS[kernel](**a, scale=scale), x, cot)
    compare(ref, tri, {**GRAD_TOL, "o": 0.004 if kernel == "chunk" else 0.005})


@pytest.mark.parametrize("chunk_size", [16, 32, 64, 128])
def test_simple_gla_chunk_with_chunk_size(chunk_size):
    x = {k: v.requires_grad_() for k, v in simple_gla_case(1, 100, 2, 16).items()}
    cot = cotangents_for((1, 100, 2, 16), (1, 2, 16, 16))
    ref = outputs_and_grads(lambda q, k, v, g, h0: naive_simple_gla(q, k, v, g, h0), x, cot)
    compare(ref, outputs_and_grads(lambda **a: SIMPLE_GLA_KERNELS["chunk"](**a, chunk_size=chunk_size), x, cot),
            GRAD_TOL)
    with pytest.raises(ValueError, match="must be a power of 2"):
        simple_gla.chunk_simple_gla(*(x[n] for n in "qkvg"), chunk_size=48)


@pytest.mark.parametrize("kernel", ["chunk", "fused_recurrent"])
def test_simple_gla_state_v_first(kernel):
    x = {k: v.requires_grad_() for k, v in simple_gla_case(2, 70, 2, 16).items()}
    x["v"], x["h0"] = x["v"][..., :8].detach().requires_grad_(), x["h0"][..., :8].detach().requires_grad_()
    cot = cotangents_for((2, 70, 2, 8), (2, 2, 16, 8))

    def run(v_first):
        def fn(q, k, v, g, h0):
            h = h0.transpose(-1, -2).contiguous() if v_first else h0
            o, ht = SIMPLE_GLA_KERNELS[kernel](q, k, v, g, h, state_v_first=v_first)
            return o, (ht.transpose(-1, -2) if v_first else ht)
        return outputs_and_grads(fn, x, cot)

    compare(run(False), run(True), GRAD_TOL)


@pytest.mark.parametrize("kernel", SIMPLE_GLA_KERNELS)
@pytest.mark.parametrize("cu_seqlens", [[0, 15], [0, 1, 40, 70, 130]])
def test_simple_gla_varlen(kernel, cu_seqlens):
    torch.manual_seed(42)
    cu, T, N, H, D = torch.tensor(cu_seqlens), cu_seqlens[-1], len(cu_seqlens) - 1, 2, 16
    x = dict(q=torch.randn(1, T, H, D), k=torch.randn(1, T, H, D), v=torch.randn(1, T, H, D),
             g=F.logsigmoid(torch.rand(1, T, H)), h0=torch.randn(N, H, D, D))
    x = {k: v.requires_grad_() for k, v in x.items()}
    cot = [torch.randn(1, T, H, D), torch.randn(N, H, D, D)]
    ref = outputs_and_grads(lambda h0, **s: each_sequence(naive_simple_gla, cu, s, h0, "qkvg"), x, cot)
    compare(ref, outputs_and_grads(lambda **a: SIMPLE_GLA_KERNELS[kernel](**a, cu_seqlens=cu), x, cot), GRAD_TOL)


def test_simple_gla_reverse_runs_each_sequence_backwards():
    x = {k: v.requires_grad_() for k, v in simple_gla_case(1, 70, 2, 16).items()}
    x["h0"] = torch.cat([x["h0"]] * 3).detach().requires_grad_()
    cu = torch.tensor([0, 30, 31, 70])
    cot = [torch.randn(1, 70, 2, 16), torch.randn(3, 2, 16, 16)]

    def reference(q, k, v, g, initial_state):
        o, ht = naive_simple_gla(q.flip(1), k.flip(1), v.flip(1), g.flip(1), initial_state)
        return o.flip(1), ht

    ref = outputs_and_grads(lambda h0, **s: each_sequence(reference, cu, s, h0, "qkvg"), x, cot)
    tri = outputs_and_grads(lambda **a: SIMPLE_GLA_KERNELS["fused_recurrent"](**a, reverse=True, cu_seqlens=cu), x, cot)
    compare(ref, tri, GRAD_TOL)


def test_simple_gla_parallel():
    x = simple_gla_case(2, 70, 2, 16)
    x = {k: x[k].requires_grad_() for k in "qkvg"}
    cot = [torch.randn(2, 70, 2, 16)]
    ref = outputs_and_grads(lambda q, k, v, g: naive_parallel_simple_gla(q, k, v, g, scale=0.1)[0], x, cot)
    tri = outputs_and_grads(lambda q, k, v, g: simple_gla.parallel_simple_gla(q, k, v, g, scale=0.1)[0], x, cot)
    compare(ref, tri, dict(o=0.005, dq=0.005, dk=0.005, dv=0.005, dg=0.005))
    _, attn = simple_gla.parallel_simple_gla(*(x[n] for n in "qkvg"), scale=0.1, output_attentions=True)
    fla_close("attn", naive_parallel_simple_gla(*(x[n] for n in "qkvg"), scale=0.1)[1], attn, 1e-5)


LINEAR_ATTN_KERNELS = {"chunk": simple_gla.chunk_linear_attn, "fused_chunk": simple_gla.fused_chunk_linear_attn,
                       "fused_recurrent": simple_gla.fused_recurrent_linear_attn}


@pytest.mark.parametrize("kernel", LINEAR_ATTN_KERNELS)
@pytest.mark.parametrize(("T", "scale"), [(64, None), (100, 0.1)])
def test_linear_attn(kernel, T, scale):
    torch.manual_seed(42)
    x = dict(q=torch.randn(2, T, 2, 16), k=torch.randn(2, T, 2, 16), v=torch.randn(2, T, 2, 16),
             h0=torch.randn(2, 2, 16, 16))
    x = {k: v.requires_grad_() for k, v in x.items()}
    cot = cotangents_for((2, T, 2, 16), (2, 2, 16, 16))
    ref = outputs_and_grads(lambda q, k, v, h0: naive_recurrent_linear_attn(
        q, k, v, scale=scale, initial_state=h0, output_final_state=True, normalize=False), x, cot)
    tri = outputs_and_grads(lambda q, k, v, h0: LINEAR_ATTN_KERNELS[kernel](
        q, k, v, scale=scale, initial_state=h0, output_final_state=True, normalize=False), x, cot)
    compare(ref, tri, dict(o=0.001, ht=0.001, dq=0.001, dk=0.001, dv=0.001, dh0=0.001))


@pytest.mark.parametrize("kernel", LINEAR_ATTN_KERNELS)
def test_linear_attn_normalize_grad_and_split_resume(kernel):
    """fla's test_normalize_grad and test_normalize_(zinit_)split_resume: the running key sum's normalisation
    against the naive reference, and two halves chained through ``(kv, z)`` equal one pass."""
    torch.manual_seed(42)
    x = {n: torch.randn(2, 80, 2, 16).sigmoid().requires_grad_() for n in "qkv"}
    cot = [torch.randn(2, 80, 2, 16)]
    ref = outputs_and_grads(lambda q, k, v: naive_recurrent_linear_attn(q, k, v, normalize=True)[0], x, cot)
    tri = outputs_and_grads(lambda q, k, v: LINEAR_ATTN_KERNELS[kernel](q, k, v, normalize=True)[0], x, cot)
    compare(ref, tri, dict(o=0.005, dq=0.005, dk=0.005, dv=0.005))
    fn = LINEAR_ATTN_KERNELS[kernel]

    def split(q, k, v):
        first, state = fn(q[:, :30], k[:, :30], v[:, :30], normalize=True, output_final_state=True)
        second, _ = fn(q[:, 30:], k[:, 30:], v[:, 30:], initial_state=state, normalize=True, output_final_state=True)
        return torch.cat([first, second], 1)

    compare(tri, outputs_and_grads(split, x, cot), dict(o=0.002, dq=0.005, dk=0.005, dv=0.005))


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("kernel", ["chunk", "fused_recurrent"])
def test_lightning_attn(kernel, chunk_size):
    torch.manual_seed(42)
    x = dict(q=torch.randn(1, 64, 2, 16), k=torch.randn(1, 64, 2, 16), v=torch.randn(1, 64, 2, 16),
             h0=torch.randn(1, 2, 16, 16))
    x = {k: v.requires_grad_() for k, v in x.items()}
    cot = cotangents_for((1, 64, 2, 16), (1, 2, 16, 16))
    gamma = -(8 / 2 * (1 - 1 / 4)) * torch.arange(2.0)  # lightning's decay for layer 1 of 4
    ref = outputs_and_grads(lambda q, k, v, h0: naive_simple_gla(q, k, v, gamma.expand(1, 64, 2), h0), x, cot)
    if kernel == "chunk":
        fn = lambda q, k, v, h0: simple_gla.chunk_lightning_attn(  # noqa: E731
            q, k, v, 1, 4, initial_state=h0, output_final_state=True, chunk_size=chunk_size)
    else:
        fn = lambda q, k, v, h0: simple_gla.fused_recurrent_lightning_attn(  # noqa: E731
            q, k, v, 1, 4, initial_state=h0, output_final_state=True)
    compare(ref, outputs_and_grads(fn, x, cot), dict(o=0.005, ht=0.005, dq=0.005, dk=0.005, dv=0.005, dh0=0.005))


@pytest.mark.parametrize("kernel", ["chunk", "fused_chunk", "fused_recurrent", "parallel"])
def test_retention(kernel):
    """fla's test_retention: each entry point against fla's naive_retention (no state: fla's cases start from
    zero), and the states against simple GLA with RetNet's decay; varlen as each sequence alone."""
    torch.manual_seed(42)
    x = {n: torch.randn(2, 70, 2, 16).requires_grad_() for n in "qkv"}
    cot = [torch.randn(2, 70, 2, 16)]
    calls = {"chunk": simple_gla.chunk_retention, "fused_chunk": simple_gla.fused_chunk_retention,
             "fused_recurrent": simple_gla.fused_recurrent_retention, "parallel": simple_gla.parallel_retention}
    ref = outputs_and_grads(lambda q, k, v: naive_retention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2),
                            x, cot)
    tri = outputs_and_grads(lambda q, k, v: calls[kernel](q, k, v)[0], x, cot)
    compare(ref, tri, dict(o=0.005, dq=0.005, dk=0.005, dv=0.005))
    if kernel == "parallel":
        return
    cu, h0 = torch.tensor([0, 15, 70]), torch.randn(2, 2, 16, 16)
    gamma = (1 - 2.0 ** (-5.0 - torch.arange(2.0))).log()
    packed = [t[:1].detach() for t in x.values()]
    o, ht = calls[kernel](*packed, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o_ref, ht_ref = each_sequence(naive_simple_gla, cu, dict(zip("qkv", packed), g=gamma.expand(1, 70, 2)), h0, "qkvg")
    fla_close("o", o_ref, o, 0.004)
    fla_close("ht", ht_ref, ht, 0.005)


def naive_delta(q, k, v, beta, initial_state, scale=None):
    """fla's delta_rule_recurrence (head-first; its own scale ``K ** -0.5``), a ``scale`` folded into q."""
    if scale is not None:
        q = q * scale * q.shape[-1] ** 0.5
    o, ht = delta_rule_recurrence(
        *(t.transpose(1, 2) for t in (q, k, v)), beta.transpose(1, 2), initial_state=initial_state,
        output_final_state=True)
    return o.transpose(1, 2), ht


DELTA_TOL = dict(o=0.006, ht=0.006, dq=0.008, dk=0.008, dv=0.008, dbeta=0.008, dh0=0.008)


@pytest.mark.parametrize("kernel", ["chunk", "fused_recurrent"])
@pytest.mark.parametrize(("B", "T", "H", "D", "scale", "l2norm_in_kernel", "chunk_size"),
                         [(1, 63, 1, 16, 1, False, 64), (2, 100, 2, 12, 0.1, False, 16), (2, 70, 2, 16, 1, True, 32)])
def test_delta_rule(kernel, B, T, H, D, scale, l2norm_in_kernel, chunk_size):
    torch.manual_seed(42)
    x = dict(q=torch.randn(B, T, H, D), k=F.normalize(torch.randn(B, T, H, D), p=2, dim=-1), v=torch.randn(B, T, H, D),
             beta=torch.rand(B, T, H).sigmoid(), h0=torch.randn(B, H, D, D))
    x = {k: v.requires_grad_() for k, v in x.items()}
    cot = cotangents_for((B, T, H, D), (B, H, D, D))
    ref = outputs_and_grads(lambda q, k, v, beta, h0: naive_delta(
        F.normalize(q, p=2, dim=-1), F.normalize(k, p=2, dim=-1), v, beta, h0, scale), x, cot)

    def tri(q, k, v, beta, h0):
        if not l2norm_in_kernel:
            q, k = F.normalize(q, p=2, dim=-1), F.normalize(k, p=2, dim=-1)
        options = dict(scale=scale, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2norm_in_kernel)
        if kernel == "chunk":
            return delta_rule.chunk_delta_rule(q, k, v, beta, chunk_size=chunk_size, **options)
        return delta_rule.fused_recurrent_delta_rule(q, k, v, beta, **options)

    compare(ref, outputs_and_grads(tri, x, cot), DELTA_TOL)


@pytest.mark.parametrize("kernel", ["chunk", "fused_recurrent"])
@pytest.mark.parametrize("cu_seqlens", [[0, 15], [0, 41, 100, 130]])
def test_delta_rule_varlen(kernel, cu_seqlens):
    torch.manual_seed(42)
    cu, T, N, H, D = torch.tensor(cu_seqlens), cu_seqlens[-1], len(cu_seqlens) - 1, 2, 16
    x = dict(q=torch.randn(1, T, H, D), k=F.normalize(torch.randn(1, T, H, D), p=2, dim=-1), v=torch.randn(1, T, H, D),
             beta=torch.rand(1, T, H).sigmoid(), h0=torch.randn(N, H, D, D))
    x = {k: v.requires_grad_() for k, v in x.items()}
    cot = [torch.randn(1, T, H, D), torch.randn(N, H, D, D)]
    ref = outputs_and_grads(lambda h0, **s: each_sequence(naive_delta, cu, s, h0, ("q", "k", "v", "beta")), x, cot)
    call = delta_rule.chunk_delta_rule if kernel == "chunk" else delta_rule.fused_recurrent_delta_rule
    tri = outputs_and_grads(lambda q, k, v, beta, h0: call(q, k, v, beta, initial_state=h0, output_final_state=True,
                                                            cu_seqlens=cu), x, cot)
    compare(ref, tri, dict(DELTA_TOL, o=0.005, ht=0.005))


def test_delta_rule_fused_recurrent_per_value_beta_and_checks():
    torch.manual_seed(42)
    q, k, v = torch.randn(2, 20, 2, 8), F.normalize(torch.randn(2, 20, 2, 8), dim=-1), torch.randn(2, 20, 2, 6)
    beta = torch.rand(2, 20, 2, 6)
    o, ht = delta_rule.fused_recurrent_delta_rule(q, k, v, beta, output_final_state=True)
    o_ref, ht_ref = naive_delta(q, k, v, beta, None)  # fla's recurrence takes a per-value beta too
    fla_close("o", o_ref, o, 1e-5)
    fla_close("ht", ht_ref, ht, 1e-5)
    with pytest.raises(ValueError, match="scale must be positive"):
        delta_rule.fused_recurrent_delta_rule(q, k, v, beta, scale=-1.0)
    with pytest.raises(ValueError, match="`chunk_size` must be 16, 32 or 64"):
        delta_rule.chunk_delta_rule(q, k, v[..., :8], beta[..., 0], chunk_size=128)


# --- short convolution (tests/modules/test_conv.py) -------------------------------------------------------------


def conv_ref(x, weight, bias, residual, activation, initial_state=None):
    """``[B, T, D]`` depthwise causal convolution in plain torch (a state: the ``W`` inputs before ``x``)."""
    W = weight.shape[-1]
    head = x.new_zeros(x.shape[0], W - 1, x.shape[2]) if initial_state is None else initial_state[..., 1:].transpose(1, 2)
    xp = torch.cat([head, x], 1)
    y = sum(xp[:, s : s + x.shape[1]] * weight[:, s] for s in range(W))
    y = y if bias is None else y + bias
    y = F.silu(y) if activation in ("swish", "silu") else y
    return y if residual is None else y + residual


@pytest.mark.parametrize(("B", "T", "D", "W", "activation", "has_bias", "has_residual"), [
    (2, 64, 32, 3, "swish", True, True), (2, 70, 32, 4, "swish", False, True), (2, 64, 32, 3, None, True, False),
    (1, 3, 16, 4, "swish", True, False)])
def test_conv(B, T, D, W, activation, has_bias, has_residual):
    torch.manual_seed(42)
    x = dict(x=torch.randn(B, T, D), weight=torch.randn(D, W))
    if has_bias:
        x["bias"] = torch.randn(D)
    if has_residual:
        x["residual"] = torch.randn(B, T, D)
    x = {k: v.requires_grad_() for k, v in x.items()}
    cot = [torch.randn(B, T, D)]
    ref = outputs_and_grads(lambda x, weight, bias=None, residual=None: conv_ref(x, weight, bias, residual, activation),
                            x, cot)
    tri = outputs_and_grads(lambda x, weight, bias=None, residual=None: conv.causal_conv1d(
        x, weight, bias, residual=residual, activation=activation)[0], x, cot)
    compare(ref, tri, {"o": 1e-3, **{f"d{k}": 1e-3 for k in x}})


@pytest.mark.parametrize(("N", "T", "D", "W", "activation", "with_cache"),
                         [(4, 100, 32, 3, "swish", False), (3, 64, 16, 4, None, True), (2, 3, 16, 4, "swish", True)])
def test_conv_varlen(N, T, D, W, activation, with_cache):
    """fla's test_conv_varlen and test_conv_varlen_with_cache_prefill_fwd (with the final cache of each sequence:
    its last W inputs, the initial cache's where a sequence is shorter), gradients into the cache included."""
    torch.manual_seed(42)
    lengths = [T // N] * N
    lengths[-1] += T % N
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = dict(x=torch.randn(1, T, D), weight=torch.randn(D, W), bias=torch.randn(D), residual=torch.randn(1, T, D))
    if with_cache:
        x["cache"] = torch.randn(N, D, W)
    x = {k: v.requires_grad_() for k, v in x.items()}
    cot = [torch.randn(1, T, D)] + ([torch.randn(N, D, W)] if with_cache else [])

    def ref_fn(x, weight, bias, residual, cache=None):
        ys, finals = [], []
        for n, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            state = None if cache is None else cache[n : n + 1]
            ys.append(conv_ref(x[:, bos:eos], weight, bias, residual[:, bos:eos], activation, state))
            full = torch.cat([x.new_zeros(1, D, W) if state is None else state, x[:, bos:eos].transpose(1, 2)], -1)
            finals.append(full[..., -W:])
        return (torch.cat(ys, 1), torch.cat(finals)) if cache is not None else torch.cat(ys, 1)

    def tri_fn(x, weight, bias, residual, cache=None):
        y, final = conv.causal_conv1d(x, weight, bias, residual, initial_state=cache, output_final_state=cache is not None,
                                      activation=activation, cu_seqlens=cu)
        return (y, final) if cache is not None else y

    tol = {"o": 1e-3, "ht": 1e-3, **{f"d{k}": 1e-3 for k in x}} if with_cache else {"o": 1e-3, **{f"d{k}": 1e-3 for k in x}}
    compare(outputs_and_grads(ref_fn, x, cot), outputs_and_grads(tri_fn, x, cot), tol)


@pytest.mark.parametrize(("W", "activation", "has_residual"), [(3, "swish", True), (4, None, False)])
def test_conv_decoding(W, activation, has_residual):
    """fla's test_conv_decoding: ``causal_conv1d_update`` token by token equals the whole-sequence convolution,
    and its cache ends holding the last W inputs; a bound ShortConvolution's ``step`` as its test_conv_decoding_with_cache."""
    torch.manual_seed(42)
    B, T, D = 2, 20, 16
    x, weight, bias = torch.randn(B, T, D), torch.randn(D, W), torch.randn(D)
    residual = torch.randn(B, T, D) if has_residual else None
    ref = conv_ref(x, weight, bias, residual, activation)
    cache, ys = x.new_zeros(B, D, W), []
    for t in range(T):
        y, cache = conv.causal_conv1d_update(x[:, t : t + 1], cache, None if residual is None else residual[:, t : t + 1],
                                             weight, bias, activation)
        ys.append(y)
    fla_close("y", ref, torch.cat(ys, 1), 1e-3)
    fla_close("cache", x[:, -W:].transpose(1, 2), cache, 1e-3)
    from fla.modules import ShortConvolution

    module = kernels.portable(ShortConvolution(D, W, bias=True, activation=activation))
    state = torch.randn(B, D, W)
    y, _ = module.step(x[:, :1], None, state.clone())
    expected = conv_ref(x[:, :1], module.weight[:, 0], module.bias, None, activation, state)
    fla_close("step", expected, y, 1e-3)


def test_conv_seq_idx_on_the_cuda_backends():
    """fla's mix/cuda backends take mamba's ``seq_idx`` (each token's sequence); its Triton one ignores it."""
    torch.manual_seed(42)
    x, weight = torch.randn(1, 30, 8), torch.randn(8, 4)
    cu = torch.tensor([0, 11, 30])
    seq_idx = torch.cat([torch.zeros(11), torch.ones(19)]).long()[None]
    packed = conv.causal_conv1d(x, weight, cu_seqlens=cu)[0]
    for backend in ("mix", "cuda"):
        fla_close(backend, packed, conv.causal_conv1d(x, weight, backend=backend, seq_idx=seq_idx)[0], 1e-6)
    fla_close("triton", conv.causal_conv1d(x, weight)[0], conv.causal_conv1d(x, weight, seq_idx=seq_idx)[0], 1e-6)


# --- norms, activations, rotary, losses (tests/modules/test_layernorm*.py, test_activation.py, ...) ---------------


@pytest.mark.parametrize("D", [50, 64])
def test_rmsnorm(D):
    from fla.modules import RMSNorm

    torch.manual_seed(42)
    x = {"x": torch.randn(2, 2, 40, D).requires_grad_()}
    ref_module, tri = nn.RMSNorm(D, eps=0), kernels.portable(RMSNorm(D, eps=0))
    nn.init.normal_(ref_module.weight)
    tri.weight.data.copy_(ref_module.weight.data)
    cot = [torch.randn(2, 2, 40, D)]
    compare(outputs_and_grads(lambda x: ref_module(x), x, cot), outputs_and_grads(lambda x: tri(x), x, cot),
            dict(o=1e-3, dx=1e-3))


@pytest.mark.parametrize(("D", "activation"), [(64, "silu"), (50, "sigmoid")])
def test_rmsnorm_gated(D, activation):
    from fla.modules import FusedRMSNormGated

    torch.manual_seed(42)
    x = {"x": torch.randn(2, 2, 30, D).requires_grad_(), "g": torch.randn(2, 2, 30, D).requires_grad_()}
    ref_module, tri = nn.RMSNorm(D, eps=0), kernels.portable(FusedRMSNormGated(D, eps=0, activation=activation))
    nn.init.normal_(ref_module.weight)
    tri.weight.data.copy_(ref_module.weight.data)
    act = F.silu if activation == "silu" else F.sigmoid
    cot = [torch.randn(2, 2, 30, D)]
    compare(outputs_and_grads(lambda x, g: ref_module(x) * act(g), x, cot), outputs_and_grads(tri, x, cot),
            dict(o=1e-3, dx=1e-3, dg=1e-3))


@pytest.mark.parametrize(("group_size", "norm_before_gate", "is_rms_norm"),
                         [(None, True, True), (16, False, True), (16, True, False)])
def test_gated_group_norm_of_mamba2(group_size, norm_before_gate, is_rms_norm):
    """fla's ``layernorm_gated`` (Mamba2's RMSNormGated) against its own torch reference, ``rms_norm_ref``, and
    for the LayerNorm form against torch's group norm written out."""
    from fla.modules.norm.layernorm_gated import rms_norm_ref

    torch.manual_seed(42)
    x = dict(x=torch.randn(3, 20, 64), weight=torch.randn(64), bias=torch.randn(64), z=torch.randn(3, 20, 64))
    x = {k: v.requires_grad_() for k, v in x.items()}
    cot = [torch.randn(3, 20, 64)]

    def ref_fn(x, weight, bias, z):
        if is_rms_norm:
            return rms_norm_ref(x, weight, bias, z, 1e-6, group_size, norm_before_gate)
        gated = x if norm_before_gate else x * F.silu(z)
        groups = gated.unflatten(-1, (-1, group_size))
        y = F.layer_norm(groups, (group_size,), eps=1e-6).flatten(-2) * weight + bias
        return y * F.silu(z) if norm_before_gate else y

    tri = outputs_and_grads(lambda x, weight, bias, z: norms.layernorm_fn(
        x, weight, bias, z, 1e-6, group_size, norm_before_gate, is_rms_norm), x, cot)
    compare(outputs_and_grads(ref_fn, x, cot), tri, {"o": 1e-3, **{f"d{k}": 1e-3 for k in x}})


def test_l2norm():
    torch.manual_seed(42)
    x = {"x": torch.randn(2, 30, 2, 64).requires_grad_()}
    cot = [torch.randn(2, 30, 2, 64)]
    compare(outputs_and_grads(lambda x: x / (x.square().sum(-1, keepdim=True) + 1e-6).sqrt(), x, cot),
            outputs_and_grads(lambda x: norms.l2norm(x), x, cot), dict(o=1e-5, dx=1e-5))
    assert norms.l2norm(x["x"], output_dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("noncontiguous", [False, True])
def test_activations(noncontiguous):
    torch.manual_seed(42)
    B, T, D = 2, 50, 64

    def inputs(n):
        xs = torch.randn(B, T, D * 2).chunk(2, dim=-1) if noncontiguous else tuple(torch.randn(B, T, D) for _ in range(2))
        return {name: t.detach().requires_grad_() for name, t in zip("xy", xs[:n])}

    cot = [torch.randn(B, T, D)]
    cases = [
        (activations.sigmoid, lambda x: torch.sigmoid(x), 1),
        (activations.swish, lambda x: F.silu(x), 1),
        (lambda x: activations.logsigmoid(x, 2.0), lambda x: F.logsigmoid(x) / 2.0, 1),
        (activations.swiglu, lambda x, y: F.silu(x) * y, 2),
    ]
    for ours, ref, n in cases:
        x = inputs(n)
        compare(outputs_and_grads(ref, x, cot), outputs_and_grads(ours, x, cot), {"o": 1e-3, "dx": 1e-3,
                                                                                 **({"dy": 1e-3} if n == 2 else {})})
    x = {**inputs(2), "w": torch.randn(32, D).requires_grad_(), "b": torch.randn(32).requires_grad_()}
    cot = [torch.randn(B, T, 32)]
    compare(outputs_and_grads(lambda x, y, w, b: F.linear(F.silu(x) * y, w, b), x, cot),
            outputs_and_grads(lambda x, y, w, b: activations.swiglu_linear(x, y, w, b), x, cot),
            dict(o=1e-3, dx=1e-3, dy=1e-3, dw=1e-3, db=1e-3))


def test_rotary_with_offsets_and_varlen():
    """fla's test_rotary, _with_offsets and _varlen: against fla's own ``rotary_embedding_ref``."""
    from fla.modules.rotary import RotaryEmbedding, rotary_embedding_ref

    torch.manual_seed(42)
    B, T, H, D = 2, 40, 2, 32
    rot = RotaryEmbedding(D)
    rot._update_cos_sin_cache(2 * T, device=torch.device("cpu"), dtype=torch.float32)
    cos, sin = rot._cos_cached, rot._sin_cached
    q = torch.randn(B, T, H, D, requires_grad=True)
    offsets = torch.tensor([3, 11])
    cot = [torch.randn(B, T, H, D)]
    ref = outputs_and_grads(lambda q: torch.cat([rotary_embedding_ref(q[i : i + 1], cos[o : o + T], sin[o : o + T])
                                                 for i, o in enumerate(offsets.tolist())]), {"q": q}, cot)
    tri = outputs_and_grads(lambda q: rotary.rotary_embedding(q, cos, sin, seqlen_offsets=offsets), {"q": q}, cot)
    compare(ref, tri, dict(o=1e-5, dq=1e-5))
    cu = torch.tensor([0, 7, 40])
    packed = rotary.rotary_embedding(q[:1], cos, sin, cu_seqlens=cu)
    alone = torch.cat([rotary_embedding_ref(q[:1, a:b], cos[: b - a], sin[: b - a]) for a, b in ((0, 7), (7, 40))], 1)
    fla_close("varlen", alone, packed, 1e-5)
    inplace = q.detach().clone()
    out = rotary.rotary_embedding(inplace, cos, sin, inplace=True)
    assert out is inplace
    fla_close("inplace", rotary_embedding_ref(q.detach(), cos[:T], sin[:T]), inplace, 1e-5)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_cross_entropy_losses(softcap):
    """fla's test_fused_cross_entropy(_softcap) and test_fused_linear_cross_entropy(_softcap), fp32."""
    torch.manual_seed(42)
    N, D, V = 64, 32, 100
    target = torch.randint(0, V, (N,))
    target[::7] = -100
    logits = {"logits": (torch.randn(N, V) * 10).requires_grad_()}
    cot = [torch.randn(())]

    def capped(z):
        return z if softcap is None else softcap * torch.tanh(z / softcap)

    ref = outputs_and_grads(lambda logits: F.cross_entropy(capped(logits), target), logits, cot)
    tri = outputs_and_grads(lambda logits: losses.FusedCrossEntropyLoss(logit_softcapping=softcap)(logits, target),
                            logits, cot)
    compare(ref, tri, dict(o=1e-2, dlogits=1e-2))
    x = {"x": torch.randn(N, D).requires_grad_(), "w": torch.randn(V, D).requires_grad_(), "b": torch.randn(V).requires_grad_()}
    ref = outputs_and_grads(lambda x, w, b: F.cross_entropy(capped(F.linear(x, w, b)), target), x, cot)
    tri = outputs_and_grads(lambda x, w, b: losses.fused_linear_cross_entropy_loss(x, target, w, b,
                                                                                   logit_softcapping=softcap), x, cot)
    compare(ref, tri, dict(o=1e-2, dx=1e-2, dw=1e-2, db=1e-2))
