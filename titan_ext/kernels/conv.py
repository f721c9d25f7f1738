"""Torch-native causal depthwise convolution for ``fla.modules.ShortConvolution``.

Each function takes fla 0.6.0's parameters, names and defaults (``kernels.signature``). Conventions follow
fla's kernels: ``x`` is ``[B, T, D]``, ``weight`` is
``[D, W]``, and a conv state is ``[N, D, W]`` holding the last ``W`` inputs
(newest last), so output ``t`` sees ``state[..., 1:]`` followed by ``x``.
The activation is applied before the residual is added.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_ext.kernels.norms import _upcast
from titan_ext.kernels.signature import refuse
from titan_ext.kernels.table import TRITON, Kernel
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
    _, position = token_sequences(cu_seqlens, x.shape[1])
    return _conv_positions(x, weight, bias, residual, activation, lambda s: (position >= s)[None])


def _same_sequence(seq_idx: torch.Tensor, s: int) -> torch.Tensor:
    """``[B, T]``: whether the token ``s`` back is in the same sequence (mamba's ``seq_idx``, ``[B, T]``)."""
    return seq_idx == F.pad(seq_idx, (s, 0), value=-1)[:, : seq_idx.shape[1]]


def _conv_positions(x, weight, bias, residual, activation, reaches):
    """``[B, T, D]`` convolved tap by tap, tap ``s`` (``s`` tokens back) kept where ``reaches(s)`` (``[B or 1,
    T]``) holds: the token ``s`` back is in the same sequence."""
    T, W = x.shape[1], weight.shape[-1]
    xu, w = _upcast(x), _upcast(weight)
    y = xu * w[:, W - 1]
    for s in range(1, W):
        earlier = F.pad(xu, (0, 0, s, 0))[:, :T]  # x[t - s]
        y = y + earlier * reaches(s)[..., None] * w[:, W - 1 - s]
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
    backend: str | None = "triton",
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    cp_context=None,
    *,
    seq_idx: torch.Tensor | None = None,
):
    """Torch version of ``fla.modules.causal_conv1d.ops.causal_conv1d``; returns ``(y, final_state)``.

    ``backend`` picks fla's kernel (the same math here): ``"triton"`` ignores ``seq_idx`` as fla's does;
    ``"mix"`` and ``"cuda"`` take it (``[B, T]``, each token's sequence: a tap never reaches a token of
    another sequence). ``chunk_indices`` is fla's precomputed form of ``cu_seqlens``. Under TP
    ``weight``/``bias`` are DTensor shards of the channels ``x`` holds locally (``tp_local``).
    """
    weight, bias = local(weight), local(bias)
    if backend not in ("triton", "mix", "cuda"):
        raise ValueError(f"Unsupported backend: {backend}")
    if weight is None:
        refuse("causal_conv1d", "weight=None", "fla's kernels need a weight too")
    if cp_context is not None:
        refuse("causal_conv1d", "fla's context parallel (cp_context)",
               "titan_ext's context parallelism hands each rank the previous piece's tail (kernels.state_passing)")
    if backend == "triton":
        seq_idx = None
    shape, W = x.shape, weight.shape[-1]
    x = x.reshape(x.shape[0], x.shape[1], -1)
    if residual is not None:
        residual = residual.reshape(x.shape)
    if seq_idx is not None:
        if cu_seqlens is not None or initial_state is not None:
            raise ValueError("seq_idx takes neither cu_seqlens nor initial_state")
        y = _conv_positions(x, weight, bias, residual, activation, lambda s: _same_sequence(seq_idx, s))
        final = F.pad(_upcast(x).transpose(1, 2), (W, 0))[..., -W:]  # the last W inputs of each row
    elif cu_seqlens is None:
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


def causal_conv1d_update(
    x: torch.Tensor,
    cache: torch.Tensor,
    residual: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
):
    """Torch version of fla's one-token decode step: shifts ``cache`` in place, as fla does."""
    weight, bias = local(weight), local(bias)
    if weight is None:
        refuse("causal_conv1d_update", "weight=None", "fla's kernel needs a weight too")
    shape, D = x.shape, cache.shape[1]
    x_new = x.reshape(-1, D)
    cache.copy_(torch.cat([cache[..., 1:], x_new.unsqueeze(-1).to(cache.dtype)], dim=-1))
    y = (_upcast(cache) * _upcast(weight)).sum(-1)
    if bias is not None:
        y = y + _upcast(bias)
    y = _activate_add(y, activation, None if residual is None else residual.reshape(y.shape))
    return y.to(x.dtype).reshape(shape), cache


KERNELS = (
    Kernel("fla.modules.causal_conv1d.ops:causal_conv1d", causal_conv1d, TRITON),
    Kernel("fla.modules.causal_conv1d.ops:causal_conv1d_update", causal_conv1d_update, TRITON),
)
"""What titan_ext's models call instead of fla's functions (``kernels.replacements``)."""

SIGNATURES = {
    "fla.modules.causal_conv1d.ops:causal_conv1d":
        "x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False, "
        "activation=None, backend='triton', cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, "
        "cp_context=None, **kwargs",
    "fla.modules.causal_conv1d.ops:causal_conv1d_update":
        "x, cache, residual=None, weight=None, bias=None, activation=None",
}
"""Parameters (``name=default``) of the functions replaced or called by keyword, as written against them
(``host.checks.check_fla_signatures``)."""
