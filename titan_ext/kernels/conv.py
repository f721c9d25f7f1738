"""Torch-native causal depthwise convolution for ``fla.modules.ShortConvolution``.

Conventions follow fla's kernels: ``x`` is ``[B, T, D]``, ``weight`` is
``[D, W]``, and a conv state is ``[N, D, W]`` holding the last ``W`` inputs
(newest last), so output ``t`` sees ``state[..., 1:]`` followed by ``x``.
The activation is applied before the residual is added.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_ext.kernels.norms import _upcast
from titan_ext.kernels.tp_local import local
from titan_ext.kernels.varlen import check_packed_batch, sequence_spans, token_sequences


def _conv(x, weight, bias, residual, initial_state, activation):
    """One batch ``[B, T, D]``; returns the output and the padded input ``[B, D, W + T]``."""
    B, T, D = x.shape
    W = weight.shape[-1]
    xt = _upcast(x).transpose(1, 2)
    head = xt.new_zeros(B, D, W) if initial_state is None else _upcast(initial_state)
    xp = torch.cat([head, xt], dim=-1)
    y = F.conv1d(xp[..., 1:], _upcast(weight).unsqueeze(1), None if bias is None else _upcast(bias), groups=D)
    return _activate_add(y.transpose(1, 2), activation, residual).to(x.dtype), xp


def _activate_add(y, activation, residual):
    if activation in ("silu", "swish"):
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"Unsupported activation: {activation}")
    return y if residual is None else y + _upcast(residual)


def _conv_packed(x, weight, bias, residual, cu_seqlens, activation):
    """``[1, T, D]`` packed sequences, each convolved alone: tap ``s`` reaches back ``s`` tokens only
    inside the token's own sequence. Tensor ops throughout (no loop over sequences, no host sync),
    so compiled code is one graph for any number of sequences."""
    T, W = x.shape[1], weight.shape[-1]
    _, position = token_sequences(cu_seqlens, T)
    xu, w = _upcast(x), _upcast(weight)
    y = xu * w[:, W - 1]
    for s in range(1, W):
        earlier = F.pad(xu, (0, 0, s, 0))[:, :T]  # x[t - s]
        y = y + earlier * (position >= s)[None, :, None] * w[:, W - 1 - s]
    if bias is not None:
        y = y + _upcast(bias)
    return _activate_add(y, activation, residual).to(x.dtype)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool | None = False,
    activation: str | None = None,
    backend: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    cp_context=None,
    **kwargs,
):
    """Torch version of ``fla.modules.causal_conv1d.ops.causal_conv1d``; returns ``(y, final_state)``.

    Under TP ``weight``/``bias`` are DTensor shards of the channels ``x`` holds locally (``tp_local``).
    """
    weight, bias = local(weight), local(bias)
    if weight is None:
        raise NotImplementedError("causal_conv1d without weight is not supported off CUDA")
    if cp_context is not None:
        raise NotImplementedError("context-parallel causal_conv1d is not supported off CUDA")
    shape, W = x.shape, weight.shape[-1]
    x = x.reshape(x.shape[0], x.shape[1], -1)
    if residual is not None:
        residual = residual.reshape(x.shape)
    if cu_seqlens is None:
        y, xp = _conv(x, weight, bias, residual, initial_state, activation)
        final = xp[..., -W:]
    elif initial_state is None and not output_final_state:  # training on packed documents
        check_packed_batch(x.shape[0])
        y = _conv_packed(x, weight, bias, residual, cu_seqlens, activation)
        final = None
    else:
        ys, finals = [], []
        for n, (bos, eos) in enumerate(sequence_spans(cu_seqlens, cu_seqlens_cpu, x.shape[0])):
            y_n, xp = _conv(
                x[:, bos:eos], weight, bias, None if residual is None else residual[:, bos:eos],
                None if initial_state is None else initial_state[n : n + 1], activation,
            )
            ys.append(y_n)
            finals.append(xp[..., -W:])
        y, final = torch.cat(ys, dim=1), torch.cat(finals, dim=0)
    final_state = final.to(x.dtype) if output_final_state else None
    return y.reshape(shape), final_state


def causal_conv1d_update(x, cache, residual=None, weight=None, bias=None, activation=None, **kwargs):
    """Torch version of fla's one-token decode step: shifts ``cache`` in place, as fla does."""
    weight, bias = local(weight), local(bias)
    shape, D = x.shape, cache.shape[1]
    x_new = x.reshape(-1, D)
    cache.copy_(torch.cat([cache[..., 1:], x_new.unsqueeze(-1).to(cache.dtype)], dim=-1))
    y = (_upcast(cache) * _upcast(weight)).sum(-1)
    if bias is not None:
        y = y + _upcast(bias)
    if activation in ("silu", "swish"):
        y = F.silu(y)
    if residual is not None:
        y = y + _upcast(residual).reshape(y.shape)
    return y.to(x.dtype).reshape(shape), cache
