"""Torch-native versions of fla's Triton activations (``fla.modules.activations``).

Like fla's kernels they compute in fp32 and return the input dtype. Each takes fla 0.6.0's parameters
(where fla's function is an autograd ``Function.apply``, the parameters of its ``forward``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_ext.kernels.norms import _upcast
from titan_ext.kernels.table import TRITON, Kernel


def swish(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` (fla's ``swish`` / ``ACT2FN['swish']`` and ``['silu']``)."""
    return F.silu(_upcast(x)).to(x.dtype)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(_upcast(x)).to(x.dtype)


def logsigmoid(x: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return (F.logsigmoid(_upcast(x)) / temperature).to(x.dtype)


def swiglu(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``swish(x) * y``, the gated MLP activation."""
    return (F.silu(_upcast(x)) * _upcast(y)).to(x.dtype)


def swiglu_linear(x, y, weight, bias):
    """``F.linear(swiglu(x, y), weight, bias)``; fla fuses this to save memory, here autograd keeps it."""
    return F.linear(swiglu(x, y), weight, bias)


KERNELS = (
    Kernel("fla.modules.activations.ops:swish", swish, TRITON),
    Kernel("fla.modules.activations.ops:sigmoid", sigmoid, TRITON),
    Kernel("fla.modules.activations.ops:logsigmoid", logsigmoid, TRITON),
    Kernel("fla.modules.activations.ops:swiglu", swiglu, TRITON),
    Kernel("fla.modules.activations.ops:swiglu_linear", swiglu_linear, TRITON),
)
"""What titan_ext's models call instead of fla's functions (``kernels.replacements``)."""

SIGNATURES = {
    "fla.modules.activations.ops:logsigmoid": "x, temperature=1.0",
    "fla.modules.activations.ops:swiglu_linear": "x, y, weight, bias",
}
"""Parameters (``name=default``) of the functions replaced or called by keyword, as written against them
(``host.checks.check_fla_signatures``)."""
