"""Torch-native RMSNorm and gated RMSNorm, matching fla's fused Triton norms.

fla's kernels add the residual, normalise and scale in fp32 and write the
output in the input dtype; these functions do the same with plain torch ops,
so autograd (and DTensor / ``torch.compile``) handle them like any other code.
Each takes fla 0.6.0's parameters, names and defaults: ``rms_norm`` and
``rms_norm_gated`` (``fla.modules.norm``), ``l2norm`` (``fla.modules.norm.l2norm``),
``rmsnorm_fn`` and ``layernorm_fn`` (``fla.modules.norm.layernorm_gated``: Mamba2's
gated norm, ``RMSNormGated``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_ext.kernels.table import TRITON, Kernel


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """fp32 for low-precision inputs; fp64 stays fp64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _rms_norm_core(x, weight, bias, residual, eps, residual_in_fp32):
    """Return (normalised fp32 output, residual stream) as fla's fused-residual kernel does.

    The residual stream ``x + residual`` keeps the residual's dtype, or fp32
    with ``residual_in_fp32``; without a residual it is ``x`` itself.
    """
    xf = _upcast(x)
    if residual is not None:
        xf = xf + _upcast(residual)
        res_out = xf.to(residual.dtype)
    else:
        res_out = xf if residual_in_fp32 else x
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * _upcast(weight)
    if bias is not None:
        y = y + _upcast(bias)
    return y, res_out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-5,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
):
    """Torch version of ``fla.modules.norm.layernorm.rms_norm`` (what ``fla.modules.RMSNorm`` calls).

    ``y = (x + residual) / rms(x + residual) * weight + bias``; with ``prenorm``
    returns ``(y, x + residual)`` so the caller can carry the residual stream.
    """
    y, res_out = _rms_norm_core(x, weight, bias, residual, eps, residual_in_fp32)
    y = y.to(x.dtype)
    return (y, res_out) if prenorm else y


def rms_norm_gated(
    x: torch.Tensor,
    g: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    activation: str = "swish",
    residual: torch.Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    eps: float = 1e-6,
):
    """Torch version of ``fla.modules.norm.fused_norm_gate.rms_norm_gated`` (``FusedRMSNormGated``).

    ``rms_norm(x) * act(g)`` with ``act(g) = g * sigmoid(g)`` for ``swish``/``silu``
    or ``sigmoid(g)`` for ``sigmoid``, all in fp32.
    """
    y, res_out = _rms_norm_core(x, weight, bias, residual, eps, residual_in_fp32)
    gf = _upcast(g)
    if activation in ("swish", "silu"):
        y = y * F.silu(gf)
    elif activation == "sigmoid":
        y = y * torch.sigmoid(gf)
    else:
        raise ValueError(f"Unsupported activation: {activation}")
    y = y.to(x.dtype)
    return (y, res_out) if prenorm else y


def l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Torch version of ``fla.modules.norm.l2norm.l2norm`` (also ``l2_norm``): ``x / sqrt(sum(x^2) + eps)``
    over the last dimension in fp32, in ``output_dtype`` (default ``x``'s)."""
    xf = _upcast(x)
    y = xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)
    return y.to(x.dtype if output_dtype is None else output_dtype)


def layernorm_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    z: torch.Tensor | None = None,
    eps: float = 1e-6,
    group_size: int | None = None,
    norm_before_gate: bool = True,
    is_rms_norm: bool = False,
) -> torch.Tensor:
    """Torch version of ``fla.modules.norm.layernorm_gated.layernorm_fn``: a LayerNorm (or RMSNorm) over
    groups of ``group_size`` channels (all of them by default), gated by ``silu(z)`` after the norm
    (``norm_before_gate``) or before it; fp32 inside, ``x``'s dtype out."""
    dtype, shape = x.dtype, x.shape
    xf = _upcast(x)
    zf = None if z is None else _upcast(z)
    if zf is not None and not norm_before_gate:
        xf = xf * F.silu(zf)
    groups = xf.unflatten(-1, (-1, shape[-1] if group_size is None else group_size))
    if not is_rms_norm:
        groups = groups - groups.mean(-1, keepdim=True)
    y = (groups * torch.rsqrt(groups.square().mean(-1, keepdim=True) + eps)).flatten(-2) * _upcast(weight)
    if bias is not None:
        y = y + _upcast(bias)
    if zf is not None and norm_before_gate:
        y = y * F.silu(zf)
    return y.to(dtype)


def rmsnorm_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    z: torch.Tensor | None = None,
    eps: float = 1e-6,
    group_size: int | None = None,
    norm_before_gate: bool = True,
) -> torch.Tensor:
    """Torch version of ``fla.modules.norm.layernorm_gated.rmsnorm_fn`` (what ``RMSNormGated`` calls)."""
    return layernorm_fn(x, weight, bias, z, eps, group_size, norm_before_gate, is_rms_norm=True)


KERNELS = (
    Kernel("fla.modules.norm.layernorm:rms_norm", rms_norm, TRITON),
    Kernel("fla.modules.norm.fused_norm_gate:rms_norm_gated", rms_norm_gated, TRITON),
    Kernel(
        "fla.modules.norm.l2norm:l2norm", l2norm,
        "fla's l2_norm/l2norm (DeltaNet's, MesaNet's, RWKV-7's, PaTH's q/k norms): " + TRITON,
    ),
    Kernel(
        "fla.modules.norm.layernorm_gated:rmsnorm_fn", rmsnorm_fn,
        "what fla's RMSNormGated calls (Mamba2's, LogLinearMamba2's, Rodimus's gated norm): " + TRITON,
    ),
    Kernel("fla.modules.norm.layernorm_gated:layernorm_fn", layernorm_fn, "what fla's LayerNormGated calls: " + TRITON),
)
"""What titan_ext's models call instead of fla's functions (``kernels.replacements``)."""

SIGNATURES = {
    "fla.modules.norm.layernorm:rms_norm":
        "x, weight, bias, residual=None, eps=1e-05, prenorm=False, residual_in_fp32=False",
    "fla.modules.norm.fused_norm_gate:rms_norm_gated":
        "x, g, weight, bias, activation='swish', residual=None, prenorm=False, residual_in_fp32=False, "
        "eps=1e-06",
    "fla.modules.norm.l2norm:l2norm": "x, eps=1e-06, output_dtype=None",
    "fla.modules.norm.layernorm_gated:rmsnorm_fn":
        "x, weight, bias, z=None, eps=1e-06, group_size=None, norm_before_gate=True",
    "fla.modules.norm.layernorm_gated:layernorm_fn":
        "x, weight, bias, z=None, eps=1e-06, group_size=None, norm_before_gate=True, is_rms_norm=False",
}
"""Parameters (``name=default``) of the functions replaced or called by keyword, as written against them
(``host.checks.check_fla_signatures``)."""
