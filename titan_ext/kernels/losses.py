"""Torch-native cross entropy for fla's ``FusedCrossEntropyLoss`` and ``FusedLinearCrossEntropyLoss``.

GLAConfig defaults to ``fuse_cross_entropy=True``, so an fla model's own loss
reaches Triton too. Same options as fla's kernels (logit scale, softcapping,
label smoothing, z-loss, ignore_index) and fla 0.6.0's parameters; vocabulary
parallelism (a ``process_group`` of more than one rank) is refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fla.modules.fused_cross_entropy.ops import FusedCrossEntropyLoss as _FlaCrossEntropyLoss
from fla.modules.fused_linear_cross_entropy.ops import FusedLinearCrossEntropyLoss as _FlaLinearCrossEntropyLoss
from fla.modules.l2warp import l2_warp

from titan_ext.kernels.signature import refuse
from titan_ext.kernels.table import TRITON, Kernel


def cross_entropy_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    lse_square_scale: float = 0.0,
    logit_softcapping: float | None = None,
    ignore_index: int = -100,
    inplace_backward: bool = False,
    process_group=None,
):
    """Per-row fp32 ``(loss, z_loss)`` for ``[N, V]`` logits, 0 where ``target == ignore_index``
    (``inplace_backward``, a memory hint of fla's kernel, changes nothing here)."""
    _one_rank("cross_entropy_loss", process_group)
    z = logits.float() * logit_scale
    if logit_softcapping is not None:
        z = logit_softcapping * torch.tanh(z / logit_softcapping)
    lse = z.logsumexp(-1)
    valid = target != ignore_index
    picked = z.gather(-1, target.masked_fill(~valid, 0).unsqueeze(-1)).squeeze(-1)
    loss = lse - (1 - label_smoothing) * picked
    if label_smoothing > 0:
        loss = loss - label_smoothing * z.mean(-1)
    z_loss = lse_square_scale * lse.square()
    loss = torch.where(valid, loss + z_loss, 0.0)
    return loss, torch.where(valid, z_loss, 0.0).detach()


class FusedCrossEntropyLoss(_FlaCrossEntropyLoss):
    """fla's module with a torch forward (fla's asserts CUDA before it reaches the kernel).

    A subclass, not a new forward on fla's class: fla models build their loss
    module inside ``forward``, so a bound model must construct this class.
    """

    def forward(self, input: torch.Tensor, target: torch.Tensor):
        loss, z_loss = cross_entropy_loss(
            input, target, self.label_smoothing, self.logit_scale, self.lse_square_scale,
            self.logit_softcapping, self.ignore_index, process_group=self.process_group,
        )
        if self.reduction != "none":
            loss, z_loss = loss.sum(), z_loss.sum()
            if self.reduction == "mean":
                total = (target != self.ignore_index).sum()
                loss, z_loss = loss / total, z_loss / total
        return (loss, z_loss) if self.return_z_loss else loss


class FusedLinearCrossEntropyLoss(_FlaLinearCrossEntropyLoss):
    """fla's module with a torch forward (fla's is Triton, behind ``torch.compiler.disable``)."""

    def forward(self, x: torch.Tensor, target: torch.LongTensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
        return fused_linear_cross_entropy_loss(
            x, target, weight, bias, self.ignore_index, self.label_smoothing, self.logit_scale,
            self.logit_softcapping, self.num_chunks, self.reduction, self.use_l2warp, self.l2_penalty_factor,
            self.accumulate_grad_in_fp32, self.process_group,
        )


def _one_rank(kernel: str, process_group) -> None:
    if process_group is not None and torch.distributed.get_world_size(process_group) > 1:
        refuse(kernel, "a vocabulary-parallel process_group of more than one rank")


def fused_linear_cross_entropy_loss(
    x, target, weight, bias=None, ignore_index=-100, label_smoothing=0.0, logit_scale=1.0,
    logit_softcapping=None, num_chunks=8, reduction="mean", use_l2warp=False, l2_penalty_factor=1e-4,
    accumulate_grad_in_fp32=True, process_group=None,
):
    """Torch version of ``fla.modules.fused_linear_cross_entropy.ops.fused_linear_cross_entropy_loss``.

    Materialises the ``[N, V]`` logits (fla chunks them to save memory: ``num_chunks`` changes nothing
    here); autograd accumulates the weight's gradient in the logits' fp32 (``accumulate_grad_in_fp32``).
    ``reduction`` is ``"mean"`` (over the valid tokens) or anything else, a sum, as fla's.
    """
    _one_rank("fused_linear_cross_entropy_loss", process_group)
    logits = F.linear(x, weight, bias)
    loss, _ = cross_entropy_loss(
        logits, target, label_smoothing, logit_scale, 0.0, logit_softcapping, ignore_index,
        process_group=process_group,
    )
    loss = loss.sum()
    if reduction == "mean":
        loss = loss / target.ne(ignore_index).sum().clamp_min(1)
    if use_l2warp:
        # l2_warp normalises by shape[0] * shape[1]: present the N rows as one sequence
        loss = l2_warp(loss, logits.unsqueeze(0), l2_penalty_factor)
    return loss


KERNELS = (
    Kernel("fla.modules.fused_cross_entropy.ops:cross_entropy_loss", cross_entropy_loss, TRITON),
    Kernel(
        "fla.modules.fused_cross_entropy.ops:FusedCrossEntropyLoss", FusedCrossEntropyLoss,
        "forward asserts CUDA before reaching its kernel; a class row, since fla models build it inside forward",
    ),
    Kernel(
        "fla.modules.fused_linear_cross_entropy.ops:FusedLinearCrossEntropyLoss", FusedLinearCrossEntropyLoss,
        "Triton forward behind torch.compiler.disable; a class row, since fla models build it inside forward",
    ),
    Kernel(
        "fla.modules.fused_linear_cross_entropy.ops:fused_linear_cross_entropy_loss", fused_linear_cross_entropy_loss,
        TRITON,
    ),
)
"""What titan_ext's models call instead of fla's functions (``kernels.replacements``)."""

SIGNATURES = {
    "fla.modules.fused_cross_entropy.ops:cross_entropy_loss":
        "logits, target, label_smoothing=0.0, logit_scale=1.0, lse_square_scale=0.0, logit_softcapping=None, "
        "ignore_index=-100, inplace_backward=False, process_group=None",
    "fla.modules.fused_linear_cross_entropy.ops:fused_linear_cross_entropy_loss":
        "x, target, weight, bias=None, ignore_index=-100, label_smoothing=0.0, logit_scale=1.0, "
        "logit_softcapping=None, num_chunks=8, reduction='mean', use_l2warp=False, l2_penalty_factor=0.0001, "
        "accumulate_grad_in_fp32=True, process_group=None",
}
"""Parameters (``name=default``) of the functions replaced or called by keyword, as written against them
(``host.checks.check_fla_signatures``)."""
