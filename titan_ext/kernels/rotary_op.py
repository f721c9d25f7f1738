"""fla's rotary embedding as one torch op, fla's driver inside (the ``fla`` kernel path).

fla's ``rotary_embedding`` runs ``RotaryEmbeddingFunction``, a Triton launch a compiled block
could only call opaque (with ``RotaryEmbedding.forward`` around it: a graph break at every
softmax-attention block of a hybrid). Rotating and its gradient are one driver, fla's
``rotary_embedding_fwdbwd``: forward rotates, backward rotates the gradient back (the sine
negated), so one op, ``torch.ops.titan_ext.rotary_embedding``, is its own gradient with
``conjugate`` flipped. In-place rotation (``inplace=True``, no caller in titan_ext's models)
goes to fla's function as shipped.
"""

from __future__ import annotations

import torch
from fla.modules.rotary.ops import rotary_embedding as fla_rotary_embedding
from torch import Tensor

from titan_ext import compat
from titan_ext.kernels.op_parts import fresh
from titan_ext.kernels.table import Kernel


@torch.library.custom_op("titan_ext::rotary_embedding", mutates_args=())
def rotary_embedding_op(
    x: Tensor, cos: Tensor, sin: Tensor, seqlen_offset: int, seqlen_offsets: Tensor | None,
    cu_seqlens: Tensor | None, interleaved: bool, conjugate: bool,
) -> Tensor:
    """``x`` rotated (``conjugate``: rotated back); offsets one integer, or one per sequence (``seqlen_offsets``)."""
    y = compat.fla_block_drivers().rotary_embedding_fwdbwd(
        x=x.contiguous(), cos=cos, sin=sin, seqlen_offsets=seqlen_offset if seqlen_offsets is None else seqlen_offsets,
        cu_seqlens=cu_seqlens, interleaved=interleaved, inplace=False, conjugate=conjugate,
    )
    return y.contiguous()


@rotary_embedding_op.register_fake
def _(x, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens, interleaved, conjugate):
    return fresh(x)


def _setup_context(ctx, inputs, output):
    _, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens, interleaved, conjugate = inputs
    ctx.save_for_backward(cos, sin, seqlen_offsets, cu_seqlens)
    ctx.seqlen_offset, ctx.interleaved, ctx.conjugate = seqlen_offset, interleaved, conjugate


def _backward(ctx, dy):
    cos, sin, seqlen_offsets, cu_seqlens = ctx.saved_tensors
    dx = torch.ops.titan_ext.rotary_embedding(dy, cos, sin, ctx.seqlen_offset, seqlen_offsets, cu_seqlens,
                                              ctx.interleaved, not ctx.conjugate)
    return dx, None, None, None, None, None, None, None


rotary_embedding_op.register_autograd(_backward, setup_context=_setup_context)


def rotary_embedding(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     chunk_indices=None):
    """fla's ``rotary_embedding`` (same arguments and returns) through ``titan_ext::rotary_embedding``
    (``chunk_indices``: fla's driver derives its own from ``cu_seqlens``, at its own chunk size)."""
    if inplace:
        return fla_rotary_embedding(x, cos, sin, interleaved=interleaved, inplace=True, seqlen_offsets=seqlen_offsets,
                                    cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    offsets = seqlen_offsets if isinstance(seqlen_offsets, Tensor) else None
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # an fp32 cache under compile (``rotary.fill_caches``)
    return torch.ops.titan_ext.rotary_embedding(x, cos, sin, 0 if offsets is not None else int(seqlen_offsets),
                                                offsets, cu_seqlens, interleaved, False)


KERNELS = (
    Kernel(
        "fla.modules.rotary.ops:rotary_embedding", rotary_embedding,
        "fla's rotation as a torch op around fla's own driver: compile keeps it, and RotaryEmbedding's forward, "
        "in the block's graph (fla's is a Triton autograd.Function, a graph break per call)",
        ("fla",),
    ),
)
"""What titan_ext's models call instead of fla's functions (``kernels.replacements``)."""

SIGNATURES = {
    "fla.modules.rotary.ops:rotary_embedding_fwdbwd":
        "x, cos, sin, seqlen_offsets=0, cu_seqlens=None, interleaved=False, inplace=False, conjugate=False, chunk_indices=None",
}
"""Parameters (``name=default``) of the functions replaced or called by keyword, as written against them
(``host.checks.check_fla_signatures``)."""
