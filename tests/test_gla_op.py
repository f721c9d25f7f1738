"""fla's chunk_gla as torch ops (``titan_ext::chunk_gla_fwd`` / ``chunk_gla_bwd``).

On CPU: torch's own op checks (schema, fake tensors, autograd registration,
AOT dispatch), gradients equal to the portable autograd path, the CUDA fake
shapes fla's backward expects, and the wiring to fla's drivers. The CUDA
kernels themselves are compared with fla's ``chunk_gla`` where a GPU exists.
"""

from __future__ import annotations

from unittest import mock

import fla.ops.gla
import pytest
import torch
from fla.layers.gla import GatedLinearAttention
from helpers import gla_inputs, leaves
from torch._subclasses.fake_tensor import FakeTensorMode

import titan_ext.kernels as kernels
from titan_ext import compat
from titan_ext.kernels import gla as portable
from titan_ext.kernels import gla_op

FWD, BWD = torch.ops.titan_ext.chunk_gla_fwd.default, torch.ops.titan_ext.chunk_gla_bwd.default


def inputs(B=2, T=37, H=3, K=8, V=16, dtype=torch.float64, h0=True, device="cpu"):
    return gla_inputs(B, T, H, K, V, with_h0=h0, dtype=dtype, device=device)


@pytest.mark.parametrize("path,wrapper", [("portable", gla_op.portable_chunk_gla), ("fla", gla_op.chunk_gla)])
def test_bound_gla_layers_call_the_op_wrapper_on_both_paths(path, wrapper):
    assert kernels.replacements(path)[fla.ops.gla.chunk_gla] is wrapper
    layer = kernels.bind(GatedLinearAttention(hidden_size=32, num_heads=2, layer_idx=0), path)
    assert type(layer).forward.__globals__["chunk_gla"] is wrapper
    assert GatedLinearAttention.forward.__globals__["chunk_gla"] is fla.ops.gla.chunk_gla  # fla unchanged
    assert gla_op.SAVE_LIST == {FWD}


@pytest.mark.parametrize(
    "h0, final_state, state_v_first, lengths",
    [(True, True, False, None), (False, False, True, None), (True, True, True, [7, 30]), (False, True, False, [37])],
)
def test_opcheck(h0, final_state, state_v_first, lengths):
    B = 1 if lengths else 2
    q, k, v, g, state = inputs(B=B, h0=h0)
    cu = None
    if lengths:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        state = state[:1].expand(len(lengths), -1, -1, -1).contiguous() if h0 else None
    if state_v_first and state is not None:
        state = state.transpose(-1, -2).contiguous()
    args = leaves(q, k, v, g, state)
    torch.library.opcheck(FWD, (*args[:4], 0.3, args[4], final_state, state_v_first, cu, cu, False))
    do = torch.randn_like(v)
    N = B if cu is None else len(lengths)
    dht = (torch.randn(N, 3, 16, 8) if state_v_first else torch.randn(N, 3, 8, 16)) if final_state else None
    A = torch.empty(0)
    torch.library.opcheck(BWD, (q, k, v, g, A, state, do, dht, 0.3, state_v_first, cu, cu, False))


def assert_op_matches(op, reference, q, k, v, g, state, grad_tol):
    """The op path (``op``: a kernel path's wrapper) against ``reference``: outputs bit for bit, gradients
    within ``grad_tol``."""
    ours, ref = leaves(q, k, v, g, state), leaves(q, k, v, g, state)
    o, ht = op(*ours[:4], initial_state=ours[4], output_final_state=True)
    o_ref, ht_ref = reference(*ref[:4], initial_state=ref[4], output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(ht, ht_ref, rtol=0, atol=0)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    torch.autograd.backward((o, ht), (do, dht))
    torch.autograd.backward((o_ref, ht_ref), (do, dht))
    worst = 0.0
    for a, b in zip(ours, ref):
        if a is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=grad_tol, atol=grad_tol)
            worst = max(worst, (a.grad - b.grad).abs().max().item())
    print(f"{q.device.type} {q.dtype}: outputs bit for bit, gradients within {worst:.1e} (max abs)")


@pytest.mark.parametrize("h0", [True, False])
def test_op_gradients_equal_the_portable_autograd_path(h0):
    assert_op_matches(gla_op.portable_chunk_gla, portable.chunk_gla, *inputs(h0=h0), grad_tol=1e-12)


def test_op_checks_arguments_like_fla():
    q, k, v, g, state = inputs(B=2)
    with pytest.raises(ValueError, match="With `cu_seqlens` the batch size must be 1, not 2"):
        gla_op.chunk_gla(q, k, v, g, cu_seqlens=torch.tensor([0, 37]))
    with pytest.raises(ValueError, match="initial_state must be float32"):
        gla_op.chunk_gla(q, k, v, g, initial_state=state.double())
    with pytest.raises(ValueError, match="q, k and g must have one shape"):
        gla_op.chunk_gla(q, k[..., :4], v, g)


@pytest.mark.parametrize("T, chunk", [(1, 16), (16, 16), (20, 32), (64, 64), (2048, 64)])
def test_cuda_fake_shapes_are_flas(T, chunk):
    """Under compile the fake decides the buffers: A must be fla's [B, T, H, chunk] fp32 (fla's kernels)."""
    assert gla_op.fla_chunk_size(T) == chunk
    with FakeTensorMode():
        q = torch.empty(2, T, 4, 8, device="cuda", dtype=torch.bfloat16)
        v = torch.empty(2, T, 4, 16, device="cuda", dtype=torch.bfloat16)
        o, ht, A = FWD(q, q, v, q, 0.3, None, True, True, None, None, True)
        assert (o.shape, o.dtype) == (v.shape, torch.bfloat16)
        assert (ht.shape, ht.dtype) == ((2, 4, 16, 8), torch.float32)
        assert (A.shape, A.dtype) == ((2, T, 4, chunk), torch.float32)
        grads = BWD(q, q, v, q, A, None, o, None, 0.3, True, None, None, True)
        assert [(x.shape, x.dtype) for x in grads[:4]] == [(x.shape, x.dtype) for x in (q, q, v, q)]


def test_cuda_path_wiring_to_fla_drivers():
    """What reaches fla's drivers and what comes back (the kernels themselves need a GPU)."""
    q, k, v, g, state = inputs(B=1, T=100)
    cu = torch.tensor([0, 40, 100])
    drivers = compat.fla_gla_drivers()
    with mock.patch.object(drivers, "chunk_gla_fwd", return_value=("gc", "A", "h", "ht", "o")) as fwd:
        assert gla_op._fla_forward(q, k, v, g, 0.3, None, True, True, cu, None) == ("o", "ht", "A")
    kwargs = fwd.call_args.kwargs
    assert kwargs["g_cumsum"] is None and kwargs["chunk_size"] == 64 and kwargs["state_v_first"]
    assert kwargs["chunk_indices"].tolist() == [[0, 0], [1, 0]]
    with mock.patch.object(drivers, "chunk_gla_bwd", return_value="grads") as bwd:
        assert gla_op._fla_backward(q, k, v, g, "A", state, v, None, 0.3, False, None, None) == "grads"
    kwargs = bwd.call_args.kwargs
    assert kwargs["A"] == "A" and kwargs["h"] is None and kwargs["g_cumsum"] is None
    assert kwargs["chunk_indices"] is None and kwargs["chunk_size"] == 64 and kwargs["dht"] is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's Triton kernels need a CUDA GPU")
@pytest.mark.parametrize("h0", [True, False])
def test_cuda_op_matches_fla_chunk_gla(h0):
    """The same kernels on the same inputs; gradients get bf16 slack in case a backward kernel is not deterministic."""
    q, k, v, g, state = inputs(B=2, T=300, H=4, K=64, V=64, dtype=torch.bfloat16, h0=h0, device="cuda")
    assert_op_matches(gla_op.chunk_gla, fla.ops.gla.chunk_gla, q, k, v, g, state, grad_tol=1e-2)
