"""fla's chunk_gated_delta_rule as torch ops (``titan_ext::chunk_gated_delta_rule_fwd`` / ``_bwd``, the CUDA path's
Gated DeltaNet core).

On CPU: the binding (fla's GatedDeltaNet layer calls the op wrapper on the fla path) and the save list. The op
against fla's function bit for bit, with strided inputs as fla's fused q/k/v convolution leaves them, and a whole
model under CP=2 and TP=2 run under Triton's interpreter (``tests/interpret_checks.py``: ``block_ops``, ``cp``,
``tp``, ``compiled_blocks``); on CUDA here (``bench/gpu_proof.py tests``).
"""

from __future__ import annotations

import fla.ops.gated_delta_rule.chunk as fla_chunk
import pytest
import torch
from fla.layers.gated_deltanet import GatedDeltaNet
from helpers import assert_outputs_exact_and_gradients_close

import titan_ext.kernels as kernels
from titan_ext.kernels import gated_delta_op
from titan_ext.parallel import activation_checkpoint

FWD = torch.ops.titan_ext.chunk_gated_delta_rule_fwd.default
FLA_MIXER = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True,
                 use_gate_in_kernel=True)
"""The in-kernel options fla's GatedDeltaNet passes."""


def test_bound_gated_deltanet_layers_call_the_op_on_the_fla_path_and_sac_saves_it():
    assert kernels.replacements("fla")[fla_chunk.chunk_gated_delta_rule] is gated_delta_op.chunk_gated_delta_rule
    layer = kernels.bind(GatedDeltaNet(hidden_size=64, num_heads=2, head_dim=16, layer_idx=0), "fla")
    assert type(layer).forward.__globals__["chunk_gated_delta_rule"] is gated_delta_op.chunk_gated_delta_rule
    assert GatedDeltaNet.forward.__globals__["chunk_gated_delta_rule"] is fla_chunk.chunk_gated_delta_rule
    assert gated_delta_op.SAVE_LIST == {FWD} and FWD in activation_checkpoint.op_sac_save_list()


def run(kernel, leaves, cu_seqlens, K, V):
    """``kernel`` as GatedDeltaNet calls it, q, k and v strided views of one tensor (fla's fused convolution),
    then backward: outputs and every leaf's gradient."""
    xs = [x.detach().clone().requires_grad_() for x in leaves]
    fused, g, beta, A_log, dt_bias, h0 = xs
    q, k, v = fused.split((K, K, V), dim=-1)
    o, ht = kernel(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0, output_final_state=True,
                   cu_seqlens=cu_seqlens, **FLA_MIXER)
    gen = torch.Generator(o.device).manual_seed(1)
    torch.autograd.backward((o, ht), (torch.randn(o.shape, generator=gen, device=o.device, dtype=o.dtype),
                                      torch.randn(ht.shape, generator=gen, device=o.device)))
    return [o.detach(), ht.detach()] + [x.grad for x in xs]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's Triton kernels need a CUDA GPU (on CPU: "
                    "tests/interpret_checks.py block_ops, under TRITON_INTERPRET=1)")
def test_cuda_op_matches_fla_chunk_gated_delta_rule_on_strided_inputs():
    """One packed row of two sequences with initial and final states, bf16: the same kernels, so the outputs bit
    for bit (gradients get bf16 slack in case a backward kernel is not deterministic)."""
    T, H, K, V = 300, 4, 64, 64
    gen = torch.Generator("cuda").manual_seed(0)
    randn = lambda *s, dtype=torch.bfloat16: torch.randn(*s, generator=gen, device="cuda", dtype=dtype)  # noqa: E731
    leaves = [randn(1, T, H, 2 * K + V), randn(1, T, H), randn(1, T, H), randn(H, dtype=torch.float32) / 4,
              randn(H, dtype=torch.float32), randn(2, H, V, K, dtype=torch.float32) / 4]
    cu = torch.tensor([0, 100, 300], device="cuda")
    reference = run(fla_chunk.chunk_gated_delta_rule, leaves, cu, K, V)
    ours = run(gated_delta_op.chunk_gated_delta_rule, leaves, cu, K, V)
    assert_outputs_exact_and_gradients_close(ours, reference, "cuda gated_delta_op")
