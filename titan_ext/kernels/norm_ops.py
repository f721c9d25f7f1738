"""fla's RMS norms (plain and gated) as two torch ops, fla's drivers inside (the ``fla`` kernel path).

fla's ``rms_norm`` and ``rms_norm_gated`` are autograd Functions of Triton launches
(``LayerNormFunction``, ``LayerNormGatedFunction``): called opaque, each one broke a
compiled block's graph (a block's two pre-norms, GLA's and the delta rules' output norm).
Here both are ``torch.ops.titan_ext.rms_norm_fwd`` (``g`` given: the gated norm) with an
autograd formula calling ``titan_ext::rms_norm_bwd``: fla's ``layer_norm_fwd``/``bwd`` or
``layer_norm_gated_fwd``/``bwd``, as those Functions call them, so the numbers are fla's.
The residual fla adds before normalising (``prenorm``) is an output of its own only
where fla makes one (a residual given, or kept in fp32): otherwise it is the input itself.
"""

from __future__ import annotations

import torch
from torch import Tensor

from titan_ext import compat
from titan_ext.kernels.op_parts import empty, fresh, present

_FP32 = torch.float32


def _rows(x: Tensor | None) -> Tensor | None:
    return None if x is None else x.reshape(-1, x.shape[-1]).contiguous()


def _keeps_residual(x: Tensor, residual: Tensor | None, residual_in_fp32: bool) -> bool:
    """Whether fla's forward makes a residual of its own (else it hands back ``x``)."""
    return residual is not None or (residual_in_fp32 and x.dtype != _FP32)


@torch.library.custom_op("titan_ext::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(
    x: Tensor, g: Tensor | None, weight: Tensor | None, bias: Tensor | None, residual: Tensor | None, eps: float,
    residual_in_fp32: bool, activation: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, rstd, residual out or empty)``; ``g``: the gate of fla's gated norm (``activation`` on it)."""
    fla = compat.fla_block_drivers()
    residual_dtype = residual.dtype if residual is not None else (_FP32 if residual_in_fp32 else None)
    common = dict(x=_rows(x), weight=weight, bias=bias, eps=eps, residual=_rows(residual),
                  residual_dtype=residual_dtype, is_rms_norm=True)
    if g is None:
        y, _, rstd, res_out = fla.layer_norm_fwd(**common)
    else:
        y, _, rstd, res_out = fla.layer_norm_gated_fwd(g=_rows(g), activation=activation, **common)
    kept = res_out.view(x.shape) if _keeps_residual(x, residual, residual_in_fp32) else empty(x)
    return y.view(x.shape), rstd, kept


@rms_norm_fwd.register_fake
def _(x, g, weight, bias, residual, eps, residual_in_fp32, activation):
    rows = x.numel() // x.shape[-1]
    dtype = residual.dtype if residual is not None else _FP32
    kept = x.new_empty(x.shape, dtype=dtype) if _keeps_residual(x, residual, residual_in_fp32) else empty(x)
    return fresh(x), x.new_empty(rows, dtype=_FP32), kept


@torch.library.custom_op("titan_ext::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(
    dy: Tensor, x: Tensor, g: Tensor | None, weight: Tensor | None, bias: Tensor | None, rstd: Tensor,
    dresidual: Tensor | None, has_residual: bool, x_dtype: torch.dtype, eps: float, activation: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dg, dweight, dbias, dresidual)``, each empty where absent; ``x``: what the norm read (the residual
    sum under ``prenorm``), and ``dresidual`` the residual's gradient only where it is not ``dx``'s."""
    fla = compat.fla_block_drivers()
    common = dict(dy=_rows(dy), x=_rows(x), weight=weight, bias=bias, rstd=rstd, has_residual=has_residual,
                  is_rms_norm=True, x_dtype=x_dtype)
    if g is None:
        dx, dw, db, dres = fla.layer_norm_bwd(mean=None, dres=_rows(dresidual), **common)
        dg = None
    else:
        dx, dg, dw, db, dres = fla.layer_norm_gated_bwd(g=_rows(g), activation=activation, eps=eps, mean=None,
                                                        dresidual=_rows(dresidual), **common)
    return (dx.view(x.shape), empty(x) if dg is None else dg.view(g.shape).to(g.dtype),
            empty(x) if dw is None else dw, empty(x) if db is None else db,
            dres.view(x.shape) if _separate_dresidual(x, has_residual, x_dtype) else empty(x))


@rms_norm_bwd.register_fake
def _(dy, x, g, weight, bias, rstd, dresidual, has_residual, x_dtype, eps, activation):
    return (x.new_empty(x.shape, dtype=x_dtype), empty(x) if g is None else fresh(g),
            empty(x) if weight is None else fresh(weight), empty(x) if bias is None else fresh(bias),
            fresh(x) if _separate_dresidual(x, has_residual, x_dtype) else empty(x))


def _separate_dresidual(x: Tensor, has_residual: bool, x_dtype: torch.dtype) -> bool:
    """Whether fla's backward makes the residual's gradient a tensor of its own (else it is ``dx`` itself)."""
    return has_residual and x.dtype != x_dtype


def _setup_context(ctx, inputs, output):
    x, g, weight, bias, residual, eps, residual_in_fp32, activation = inputs
    _, rstd, kept = output
    ctx.save_for_backward(kept if kept.numel() else x, g, weight, bias, rstd)
    ctx.has_residual, ctx.x_dtype, ctx.eps, ctx.activation = residual is not None, x.dtype, eps, activation
    ctx.mark_non_differentiable(rstd)


def _backward(ctx, dy, _drstd, dresidual):
    x, g, weight, bias, rstd = ctx.saved_tensors
    dx, dg, dw, db, dres = torch.ops.titan_ext.rms_norm_bwd(
        dy, x, g, weight, bias, rstd, present(dresidual), ctx.has_residual, ctx.x_dtype, ctx.eps, ctx.activation)
    dres = dres if dres.numel() else dx
    return (dx, present(dg), present(dw), present(db), dres if ctx.has_residual else None, None, None, None)


rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False):
    """fla's ``rms_norm`` (same arguments and returns) through ``titan_ext::rms_norm_fwd``/``bwd``."""
    return _through_ops(x, None, weight, bias, residual, eps, prenorm, residual_in_fp32, "swish")


def rms_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False, residual_in_fp32=False,
                   eps=1e-6):
    """fla's ``rms_norm_gated`` (same arguments and returns) through the same ops."""
    return _through_ops(x, g, weight, bias, residual, eps, prenorm, residual_in_fp32, activation)


def _through_ops(x, g, weight, bias, residual, eps, prenorm, residual_in_fp32, activation):
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, not {tuple(residual.shape)}.")
    y, _, kept = torch.ops.titan_ext.rms_norm_fwd(x, g, weight, bias, residual, float(eps), residual_in_fp32,
                                                  activation)
    return (y, kept if kept.numel() else x) if prenorm else y

SIGNATURES = {
    "fla.modules.norm.layernorm:rms_norm":
        "x, weight, bias, residual=None, eps=1e-05, prenorm=False, residual_in_fp32=False",
    "fla.modules.norm.fused_norm_gate:rms_norm_gated":
        "x, g, weight, bias, activation='swish', residual=None, prenorm=False, residual_in_fp32=False, eps=1e-06",
    "fla.modules.norm.layernorm:layer_norm_fwd":
        "x, weight, bias, eps=1e-05, residual=None, out_dtype=None, residual_dtype=None, is_rms_norm=False, num_groups=1",
    "fla.modules.norm.layernorm:layer_norm_bwd":
        "dy, x, weight, bias, mean=None, rstd=None, dres=None, has_residual=False, is_rms_norm=False, x_dtype=None, recompute_output=False, num_groups=1",
    "fla.modules.norm.fused_norm_gate:layer_norm_gated_fwd":
        "x, g, weight, bias, activation='swish', eps=1e-05, residual=None, out_dtype=None, residual_dtype=None, is_rms_norm=False",
    "fla.modules.norm.fused_norm_gate:layer_norm_gated_bwd":
        "dy, x, g, weight, bias, activation='swish', eps=1e-05, mean=None, rstd=None, dresidual=None, has_residual=False, is_rms_norm=False, x_dtype=None, recompute_output=False",
}
"""Parameters (``name=default``) of the functions replaced or called by keyword, as written against them
(``host.checks.check_fla_signatures``)."""
