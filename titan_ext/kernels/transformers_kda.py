"""transformers' Kimi Linear KDA layer (``KimiLinearDeltaAttention``) on titan_ext's kernels, documents kept apart.

Its forward calls two module functions: ``chunk_kimi_delta_attention(query, key, value, g=, beta=, ...,
**kwargs)`` (fla's ``chunk_kda`` contract, ``[B, T, H, *]`` rows) and ``causal_conv1d_fn(x, weight, bias,
activation, **kwargs)`` (``x`` ``[B, C, T]``, the q, k and v channels convolved in one call, the activation
inside). Packed documents reach both only as ``cu_seq_lens_q`` in ``kwargs`` (over the flattened batch, the
keyword transformers hands every layer; ``titan_ext.data.documents``), which neither reads. Here each call runs
on one packed row with ``cu_seqlens`` when boundaries are given, so the state and the convolution restart
at every document; without them it is the plain call. its ``KERNELS`` bind them.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch.distributed.tensor import DTensor, Partial

from titan_ext.kernels import conv, kda, kda_op
from titan_ext.kernels.table import Kernel
from titan_ext.kernels.tp_local import local

PROJECTIONS = 3
"""q, k and v: the layer convolves their outputs in one ``conv1d``, concatenated in that order."""


def packed_row(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, ...]`` -> ``[1, B * T, ...]``: rows back to back, as fla's ``cu_seqlens`` counts them."""
    return x.reshape(1, -1, *x.shape[2:])


def rows_as_packed(kernel, q, k, v, g, beta, cu_seqlens, **kwargs):
    """``kernel`` (fla's ``chunk_kda`` contract) on ``[B, T]`` rows; with ``cu_seqlens`` (over the flattened
    batch) on one packed row, the output back in rows. Under TP the forget gate's ``g`` is a DTensor of this
    rank's heads (``mixers.TransformersKDA.tp_entries``): its local shard."""
    g = local(g)
    if cu_seqlens is None:
        return kernel(q, k, v, g=g, beta=beta, **kwargs)
    o, state = kernel(*map(packed_row, (q, k, v)), g=packed_row(g), beta=packed_row(beta), cu_seqlens=cu_seqlens,
                      **kwargs)
    return o.reshape(v.shape[:2] + o.shape[2:]), state


def chunk_kda(q, k, v, g=None, beta=None, cu_seq_lens_q=None, cu_seqlens=None, **kwargs):
    """The portable KDA kernel (``kernels.kda``), documents from ``cu_seq_lens_q``."""
    return rows_as_packed(kda.chunk_kda, q, k, v, g, beta, _bounds(cu_seq_lens_q, cu_seqlens, q), **_fla_keywords(kwargs))


def fla_chunk_kda(q, k, v, g=None, beta=None, cu_seq_lens_q=None, cu_seqlens=None, **kwargs):
    """fla's ``chunk_kda`` (CUDA; as torch ops around fla's drivers, ``kda_op``), documents from ``cu_seq_lens_q``."""
    return rows_as_packed(kda_op.chunk_kda, q, k, v, g, beta, _bounds(cu_seq_lens_q, cu_seqlens, q),
                          **_fla_keywords(kwargs))


@functools.cache
def _fla_parameters() -> frozenset[str]:
    from fla.ops.kda.chunk import chunk_kda as fla_chunk_kda

    return frozenset(inspect.signature(fla_chunk_kda).parameters)


def _fla_keywords(kwargs: dict) -> dict:
    """The keywords transformers' hub wrapper hands fla's ``chunk_kda``: those it names (the layer's other
    keywords, e.g. ``position_ids``, never reach a kernel)."""
    return {name: value for name, value in kwargs.items() if name in _fla_parameters()}


def _bounds(cu_seq_lens_q, cu_seqlens, q):
    """The call's packed boundaries: transformers' (over ``[B, T]`` rows) or fla's (``q`` already one row)."""
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError("cu_seqlens packs sequences into one row; got a batch of rows")
    return cu_seq_lens_q if cu_seqlens is None else cu_seqlens


def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, cu_seq_lens_q=None, kernel=conv.causal_conv1d,
                     cu_seqlens=None, **kwargs):
    """transformers' contract (``[B, C, T]`` in and out, ``weight`` ``[C, W]``) on ``kernel`` (fla's
    ``causal_conv1d`` contract, ``[B, T, C]``: titan_ext's torch convolution); with boundaries, on one
    packed row."""
    x = hidden_states.transpose(1, 2)
    weight = this_ranks_channels(weight, x.shape[-1])
    bounds = cu_seq_lens_q if cu_seqlens is None else cu_seqlens
    y, _ = kernel(x=x if bounds is None else packed_row(x), weight=weight, bias=bias, activation=activation,
                  cu_seqlens=bounds)
    return y.reshape(x.shape).transpose(1, 2)


def this_ranks_channels(weight, channels: int):
    """The convolution's weight rows for ``channels`` inputs: under TP the weight is the whole layer's, a
    replicated DTensor (``[3 * D, W]``), and the input this rank's heads of q, k and v (``3 * D / tp``
    channels): this rank's rows of each projection, their gradient summed over the ranks (``Partial``)."""
    if not isinstance(weight, DTensor):
        return weight
    whole = weight.to_local(grad_placements=[Partial()])
    if whole.shape[0] == channels:
        return whole
    parts, rank = whole.shape[0] // channels, weight.device_mesh.get_local_rank()
    return torch.cat([projection.chunk(parts)[rank] for projection in whole.chunk(PROJECTIONS)])


KERNELS = (
    Kernel(
        "transformers.models.kimi_linear.modeling_kimi_linear:chunk_kimi_delta_attention", chunk_kda,
        "transformers' Kimi Linear KDA layer calls fla's Triton kernel through this wrapper whenever fla is "
        "installed (fails off CUDA with '0 active drivers'), and hands it packed documents as cu_seq_lens_q, "
        "which no KDA kernel reads: the kernel of the path on one packed row with cu_seqlens",
    ),
    Kernel(
        "transformers.models.kimi_linear.modeling_kimi_linear:chunk_kimi_delta_attention", fla_chunk_kda,
        "transformers' Kimi Linear KDA layer calls fla's Triton kernel through this wrapper whenever fla is "
        "installed (fails off CUDA with '0 active drivers'), and hands it packed documents as cu_seq_lens_q, "
        "which no KDA kernel reads: the kernel of the path on one packed row with cu_seqlens",
        ("fla",),
    ),
    Kernel(
        "transformers.models.kimi_linear.modeling_kimi_linear:causal_conv1d_fn", causal_conv1d_fn,
        "its convolution takes packed documents as cu_seq_lens_q and convolves across them: titan_ext's torch "
        "convolution (transformers' own fallback is torch too), each document from zero",
        ("portable", "fla"),
    ),
)
"""What titan_ext's models call instead of fla's functions (``kernels.replacements``)."""

SIGNATURES = {
    "transformers.models.kimi_linear.modeling_kimi_linear:chunk_kimi_delta_attention":
        "query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False, "
        "use_qk_l2norm_in_kernel=False, **kwargs",
    "transformers.models.kimi_linear.modeling_kimi_linear:causal_conv1d_fn":
        "hidden_states, weight, bias=None, activation=None, **kwargs",
}
"""Parameters (``name=default``) of the functions replaced or called by keyword, as written against them
(``host.checks.check_fla_signatures``)."""
