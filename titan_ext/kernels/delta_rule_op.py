"""The portable delta-rule cores (Gated DeltaNet's, KDA's) as two torch ops, so op-level SAC can save them.

``run_delta_rule`` (``titan_ext.kernels.gated_delta``) is plain torch: under
op-level selective AC its chunked core is dozens of dispatcher ops per layer
(batched matmuls, triangular solves, exps) that the policy either keeps (every
other matmul, per torchtitan's list) or runs again in backward's recompute. As
``torch.ops.titan_ext.delta_rule_fwd`` it is one op whose outputs the save list
keeps (``SAVE_LIST``): one output per layer, and backward's recompute replays
it from the cache. Its backward, ``titan_ext::delta_rule_bwd``, differentiates
the core with autograd, which runs the core's forward once more there (as the
portable GLA op does: this path exists for correctness; fla's Triton kernels
are what a GPU runs).

The core is named by ``rule`` (``"gated_delta"``, ``"kda"``, as each kernel
registers it with ``register_rule``): an op cannot take a function. DTensor
inputs skip the op (``run_delta_rule`` directly).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from titan_ext import compat

_RULES: dict = {}
"""name -> ``run_delta_rule`` bound to a core and its chunk size, registered by the kernels."""


def register_rule(name: str, run) -> str:
    """Make ``run`` (``run_delta_rule`` with its core and chunk bound) callable by the op as ``name``."""
    _RULES[name] = run
    return name


def _empty(like: Tensor) -> Tensor:
    """The stand-in for an absent final state (custom ops cannot return None)."""
    return like.new_empty(0)


def run_rule(rule, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, state_v_first, out_dtype):
    """The registered core ``rule`` as plain torch ops (``delta_rule``'s arguments; no op boundary)."""
    return _RULES[rule](q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, state_v_first, out_dtype)


@torch.library.custom_op("titan_ext::delta_rule_fwd", mutates_args=())
def delta_rule_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None, output_final_state: bool,
    state_v_first: bool, cu_seqlens: Tensor | None, out_dtype: torch.dtype, rule: str,
) -> tuple[Tensor, Tensor]:
    """``(o, final state or empty)``, as ``run_delta_rule`` returns them (contiguous; the state a copy, never an input)."""
    o, ht = run_rule(rule, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, state_v_first, out_dtype)
    return o.contiguous(), (ht.clone(memory_format=torch.contiguous_format) if ht is not None else _empty(q))


@delta_rule_fwd.register_fake
def _(q, k, v, g, beta, initial_state, output_final_state, state_v_first, cu_seqlens, out_dtype, rule):
    B, T, HV, V = v.shape
    K = k.shape[-1]
    o = v.new_empty(B, T, HV, V, dtype=out_dtype)
    if not output_final_state:
        return o, _empty(q)
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return o, q.new_empty((N, HV, V, K) if state_v_first else (N, HV, K, V))


@torch.library.custom_op("titan_ext::delta_rule_bwd", mutates_args=())
def delta_rule_bwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None, do: Tensor,
    dht: Tensor | None, state_v_first: bool, cu_seqlens: Tensor | None, rule: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dg, dbeta, dh0 or empty)``: autograd through the core, run again here."""
    with compat.autograd_enabled_inside_kernel(), torch.enable_grad():
        primals = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
        h0 = initial_state.detach().requires_grad_() if initial_state is not None else None
        o, ht = run_rule(rule, *primals, h0, dht is not None, cu_seqlens, state_v_first, do.dtype)
        outputs, cotangents = [o], [do]
        if dht is not None:
            outputs.append(ht)
            cotangents.append(dht)
        inputs = primals + ([h0] if h0 is not None else [])
        grads = torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True)
    grads = [torch.zeros_like(x) if d is None else d.to(x.dtype).contiguous() for d, x in zip(grads, inputs)]
    return (*grads, _empty(q)) if h0 is None else tuple(grads)


@delta_rule_bwd.register_fake
def _(q, k, v, g, beta, initial_state, do, dht, state_v_first, cu_seqlens, rule):
    dh0 = torch.empty_like(initial_state) if initial_state is not None else _empty(q)
    return (*(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v, g, beta)), dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, output_final_state, state_v_first, cu_seqlens, out_dtype, rule = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
    ctx.output_final_state, ctx.state_v_first, ctx.rule = output_final_state, state_v_first, rule


def _backward(ctx, do, dht):
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
    dht = dht if ctx.output_final_state else None
    dq, dk, dv, dg, dbeta, dh0 = torch.ops.titan_ext.delta_rule_bwd(
        q, k, v, g, beta, initial_state, do, dht, ctx.state_v_first, cu_seqlens, ctx.rule
    )
    return dq, dk, dv, dg, dbeta, dh0 if initial_state is not None else None, None, None, None, None, None


delta_rule_fwd.register_autograd(_backward, setup_context=_setup_context)

SAVE_LIST = {torch.ops.titan_ext.delta_rule_fwd.default}
"""What op-level SAC should keep of a delta-rule core: its forward's output (one per layer)."""


def delta_rule(rule: str, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, state_v_first, out_dtype):
    """``run_delta_rule`` with the core ``rule`` (same inputs and returns), through the op where it can."""
    if any(isinstance(x, DTensor) for x in (q, k, v, g, beta, initial_state)):
        return run_rule(rule, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, state_v_first,
                        out_dtype)
    o, ht = torch.ops.titan_ext.delta_rule_fwd(
        q, k, v, g, beta, initial_state, output_final_state, state_v_first, cu_seqlens, out_dtype, rule
    )
    return o, (ht if output_final_state else None)
