"""fla's chunk_kda as torch ops (``titan_ext::chunk_kda_fwd`` / ``chunk_kda_bwd``, the CUDA path's KDA).

On CPU without a GPU: the binding (fla's KDA layer and transformers' Kimi Linear call the op wrapper on the fla
path), the save list, the fake (shape-only) implementations compile and the planner see, the argument checks,
and what goes to fla's ``chunk_kda`` as shipped. The op's kernels against fla's ``chunk_kda`` (bit for bit), its
op-level SAC (no second forward in backward) and torch's op checks run under Triton's interpreter
(``tests/interpret_checks.py``, case ``kda_op``) and, where a GPU exists, on CUDA here (``bench/gpu_proof.py``).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from unittest import mock

import fla.ops.kda
import pytest
import torch
import torch.nn.functional as F
from fla.layers.kda import KimiDeltaAttention
from helpers import assert_outputs_exact_and_gradients_close
from torch._subclasses.fake_tensor import FakeTensorMode
from torchtitan.config.job_config import ActivationCheckpoint

import titan_ext.kernels as kernels
from titan_ext import compat
from titan_ext.kernels import kda_op, transformers_kda
from titan_ext.parallel import activation_checkpoint

FWD, BWD = torch.ops.titan_ext.chunk_kda_fwd.default, torch.ops.titan_ext.chunk_kda_bwd.default
FLA_MIXER = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 state_v_first=True)
"""The in-kernel options fla's KimiDeltaAttention passes."""


def test_bound_kda_layers_call_the_op_on_the_fla_path_and_sac_saves_it():
    assert kernels.replacements("fla")[fla.ops.kda.chunk_kda] is kda_op.chunk_kda
    layer = kernels.bind(KimiDeltaAttention(hidden_size=32, num_heads=2, head_dim=16, layer_idx=0), "fla")
    assert type(layer).forward.__globals__["chunk_kda"] is kda_op.chunk_kda
    assert KimiDeltaAttention.forward.__globals__["chunk_kda"] is fla.ops.kda.chunk_kda  # fla unchanged
    assert kda_op.SAVE_LIST == {FWD} and FWD in activation_checkpoint.op_sac_save_list()
    with mock.patch.object(kda_op, "chunk_kda", return_value=("o", None)) as op:  # Kimi Linear's CUDA call
        q = torch.zeros(2, 5, 1, 16)
        transformers_kda.fla_chunk_kda(q, q, q, g=q, beta=q[..., 0], use_qk_l2norm_in_kernel=True)
    assert op.call_args.kwargs["use_qk_l2norm_in_kernel"]


@pytest.mark.parametrize("mixer", ["fla", "kimi"])
@pytest.mark.parametrize("T, lengths, chunk", [(20, None, 64), (300, [100, 200], 64), (70, [70], 32)])
def test_cuda_fake_shapes_are_flas(mixer, T, lengths, chunk):
    """Under compile (and the planner's fake tensors) the fake decides the buffers: fla's shapes and dtypes,
    grouped values included (2 value heads per q/k head)."""
    options = FLA_MIXER if mixer == "fla" else dict(use_qk_l2norm_in_kernel=True)
    B, H, HV, K, V = (1 if lengths else 2), 2, 4, 16, 32
    N = len(lengths) if lengths else B
    with FakeTensorMode():
        bf16 = dict(device="cuda", dtype=torch.bfloat16)
        q, k, v, g, beta = (torch.empty(*s, **bf16) for s in ((B, T, H, K), (B, T, H, K), (B, T, HV, V),
                                                                (B, T, HV, K), (B, T, HV)))
        A_log, dt_bias = torch.empty(HV, device="cuda"), torch.empty(HV * K, device="cuda")
        cu = torch.tensor([0, *itertools.accumulate(lengths)], device="cuda") if lengths else None
        h0 = torch.empty(N, HV, V, K, device="cuda") if mixer == "fla" else torch.empty(N, HV, K, V, device="cuda")
        gate, sigmoid, v_first = (options.get(name, False) for name in ("use_gate_in_kernel",
                                                                       "use_beta_sigmoid_in_kernel", "state_v_first"))
        out = FWD(q, k, v, g, beta, A_log, dt_bias, 0.25, h0, True, True, gate, sigmoid, False, False, None, v_first,
                  cu, None, chunk)
        o, ht, g_cumsum, Aqk, Akk, qn, q_rstd, kn, k_rstd, beta_act = out
        assert (o.shape, o.dtype) == ((B, T, HV, V), torch.bfloat16)
        assert (ht.shape, ht.dtype) == (h0.shape, torch.float32)
        assert (Aqk.shape, Aqk.dtype, Akk.shape) == ((B, T, HV, chunk), torch.bfloat16, (B, T, HV, chunk))
        assert (g_cumsum.shape, g_cumsum.dtype) == (((0,), torch.float32) if gate else ((B, T, HV, K), torch.float32))
        assert (qn.shape, qn.dtype, kn.shape, q_rstd.shape, k_rstd.dtype) == (
            q.shape, torch.bfloat16, k.shape, (B, T, H), torch.float32)
        assert beta_act.shape == (beta.shape if sigmoid else (0,))
        grads = BWD(qn, kn, v, g, beta, A_log, dt_bias, h0, g_cumsum, Aqk, Akk, q_rstd, k_rstd, beta_act, o, ht,
                    0.25, True, gate, sigmoid, False, False, None, v_first, cu, None, chunk)
        inputs = (q, k, v, g, beta, h0) + ((A_log, dt_bias) if gate else ())
        assert [(x.shape, x.dtype) for x in grads[:len(inputs)]] == [(x.shape, x.dtype) for x in inputs]
        assert all(x.shape == (0,) for x in grads[len(inputs):])


def test_op_checks_arguments_like_fla():
    q, v, beta = torch.randn(2, 20, 2, 16), torch.randn(2, 20, 2, 8), torch.rand(2, 20, 2)
    call = lambda **kw: kda_op.chunk_kda(q, q, v, q, beta, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="With `cu_seqlens` the batch size must be 1, not 2"):
        call(cu_seqlens=torch.tensor([0, 20]))
    with pytest.raises(ValueError, match="initial_state must be float32"):
        call(initial_state=torch.zeros(2, 2, 16, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="use_gate_in_kernel=True needs A_log"):
        call(use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="chunk_size must be one of"):
        call(chunk_size=16)
    with pytest.raises(ValueError, match="safe_gate=True with use_gate_in_kernel=True needs lower_bound"):
        call(use_gate_in_kernel=True, A_log=torch.zeros(2), safe_gate=True, lower_bound=-6.0)
    with pytest.raises(ValueError, match="allow_neg_eigval=True needs use_beta_sigmoid_in_kernel"):
        call(allow_neg_eigval=True)
    with pytest.raises(ValueError, match="g must be"):
        kda_op.chunk_kda(q, q, v, q[..., :8], beta)


@pytest.mark.parametrize("option", [dict(disable_recompute=True), dict(use_graph=True), dict(cp_context=object()),
                                    dict(return_intermediate_states=True)])
def test_what_the_op_does_not_take_goes_to_flas_chunk_kda(option):
    q, beta = torch.zeros(1, 8, 1, 16), torch.zeros(1, 8, 1)
    with mock.patch.object(compat.fla_kda_drivers(), "chunk_kda", return_value="shipped") as shipped:
        assert kda_op.chunk_kda(q, q, q, q, beta, A_log=q, **option) == "shipped"
    assert shipped.call_args.kwargs["A_log"] is q and all(shipped.call_args.kwargs[k] == v for k, v in option.items())


def fla_mixer_inputs(B=1, T=300, H=4, K=64, V=64, states=2, device="cuda", dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device).manual_seed(seed)
    randn = lambda *s, dtype=dtype: torch.randn(*s, generator=gen, device=device, dtype=dtype)  # noqa: E731
    return [randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V), randn(B, T, H, K), randn(B, T, H),
            randn(H, dtype=torch.float32) / 4, randn(H * K, dtype=torch.float32),
            randn(states, H, V, K, dtype=torch.float32) / 4]


def run(kernel, inputs, cu_seqlens):
    """``kernel`` as KimiDeltaAttention calls it, then backward: outputs and every input's gradient."""
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    o, ht = kernel(*xs[:5], A_log=xs[5], dt_bias=xs[6], initial_state=xs[7], output_final_state=True,
                   cu_seqlens=cu_seqlens, **FLA_MIXER)
    gen = torch.Generator(o.device).manual_seed(1)
    torch.autograd.backward((o, ht), (torch.randn(o.shape, generator=gen, device=o.device, dtype=o.dtype),
                                      torch.randn(ht.shape, generator=gen, device=o.device)))
    return [o.detach(), ht.detach()] + [x.grad for x in xs]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's Triton kernels need a CUDA GPU (on CPU: "
                    "tests/interpret_checks.py kda_op, under TRITON_INTERPRET=1)")
def test_cuda_op_matches_fla_chunk_kda_and_op_sac_saves_it():
    """The op under titan_ext's op-level SAC against fla's chunk_kda on one packed row of two sequences with
    initial and final states: the same kernels (gradients get bf16 slack in case a backward kernel is not
    deterministic), and fla's KDA forward runs once, not again in backward's recompute."""
    inputs, cu = fla_mixer_inputs(), torch.tensor([0, 100, 300], device="cuda")
    reference = run(fla.ops.kda.chunk_kda, inputs, cu)
    choice = activation_checkpoint.ac_choice(SimpleNamespace(activation_checkpoint=ActivationCheckpoint(
        mode="selective", selective_ac_option="op")))
    block = activation_checkpoint.wrap_block(Core(), 0, choice, base_fqn="layers.0")
    drivers, runs = compat.fla_kda_drivers(), []
    forward = drivers.chunk_kda_fwd
    with mock.patch.object(drivers, "chunk_kda_fwd", lambda *a, **kw: runs.append(1) or forward(*a, **kw)):
        ours = run(lambda *x, **kw: block(*x, **kw), inputs, cu)
    assert len(runs) == 1, f"fla's KDA forward ran {len(runs)} times under op SAC"
    assert_outputs_exact_and_gradients_close(ours, reference, "cuda kda_op")


class Core(torch.nn.Module):
    """A block whose only op is the KDA call."""

    def forward(self, *x, **kw):
        return kda_op.chunk_kda(*x, **kw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's Triton kernels need a CUDA GPU")
def test_cuda_kimi_linear_call_matches_fla_chunk_kda():
    """Kimi Linear's call (gate and sigmoid(beta) outside the kernel, a K-first state, two rows)."""
    q, k, v, g, beta, _, _, _ = fla_mixer_inputs(B=2)
    h0 = torch.randn(2, 4, 64, 64, device="cuda") / 4
    g, beta = -F.softplus(g.float()), beta.float().sigmoid().to(beta.dtype)
    outs = []
    for kernel in (fla.ops.kda.chunk_kda, kda_op.chunk_kda):
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, ht = kernel(*xs[:5], initial_state=xs[5], output_final_state=True, use_qk_l2norm_in_kernel=True)
        (o.float().square().sum() + ht.square().sum()).backward()
        outs.append([o, ht] + [x.grad for x in xs])
    torch.testing.assert_close(outs[1][:2], outs[0][:2], rtol=0, atol=0)
    torch.testing.assert_close(outs[1][2:], outs[0][2:], rtol=1e-2, atol=1e-2)


def test_forward_and_backward_trace_as_two_ops_on_fake_tensors():
    """What compile and the planner see: the wrapper, its checks and autograd trace on fake tensors into the
    two ops (no fla Function, nothing data-dependent)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(q, k, v, g, beta, A_log, dt_bias, h0):
        o, ht = kda_op.chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0,
                                 output_final_state=True, **FLA_MIXER)
        return torch.autograd.grad(o.float().sum() + ht.sum(), (q, k, v, g, beta, A_log, dt_bias, h0))

    shapes = ((2, 70, 2, 16), (2, 70, 2, 16), (2, 70, 2, 32), (2, 70, 2, 16), (2, 70, 2), (2,), (32,), (2, 2, 32, 16))
    inputs = [torch.zeros(s, dtype=torch.bfloat16 if i < 5 else torch.float32, requires_grad=True)
              for i, s in enumerate(shapes)]
    graph = make_fx(step, tracing_mode="fake")(*inputs)  # fake copies of the inputs: no kernel runs
    called = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert called.count(FWD) == 1 and called.count(BWD) == 1, called
