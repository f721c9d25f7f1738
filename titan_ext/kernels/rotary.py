"""fla's rotary embedding off CUDA, through fla's own torch reference (and its cache check under compile)."""

import torch
from fla.modules.rotary.ops import RotaryEmbedding, rotary_embedding_ref

from titan_ext.kernels.table import TRITON, Kernel
from titan_ext.kernels.varlen import check_packed_batch, token_sequences

_fla_update_cos_sin_cache = vars(RotaryEmbedding)["_update_cos_sin_cache"]


def rotary_embedding(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, chunk_indices=None):
    """fla's ``rotary_embedding`` through fla's torch reference: ``x`` is ``[B, T, H, D]``.

    Offsets are one integer or one per sequence (``[N]``); with ``cu_seqlens``
    (batch 1, packed sequences) positions restart at each sequence, as in fla.
    ``inplace`` writes the result into ``x`` and returns it, as fla does;
    ``chunk_indices`` is fla's precomputed form of ``cu_seqlens``.
    """
    T = x.shape[1]
    if cu_seqlens is None:
        ramp = torch.arange(T, device=x.device)
        positions = ramp + seqlen_offsets if isinstance(seqlen_offsets, int) else seqlen_offsets[:, None] + ramp
    else:
        check_packed_batch(x.shape[0])
        sequence, positions = token_sequences(cu_seqlens, T)
        positions = positions + (seqlen_offsets if isinstance(seqlen_offsets, int) else seqlen_offsets[sequence])
    y = rotary_embedding_ref(x, cos[positions].to(x.dtype), sin[positions].to(x.dtype), interleaved)
    return x.copy_(y) if inplace else y


def update_cos_sin_cache(self, seqlen, device=None, dtype=None):
    """fla's ``RotaryEmbedding._update_cos_sin_cache``, minus a graph break inside compiled blocks.

    fla's check ends with ``self._cos_cached.is_inference()``, which dynamo
    cannot trace: once the cache is filled, every call from a compiled block
    would break the graph there (5 graphs per block instead of 1). Under
    compile, a cache of the right length and device, in ``dtype`` or in fp32
    (``fill_caches``; the rotation casts it to the input's dtype, the values fla's
    own cast gives), is used as is (titan_ext never fills it under
    ``inference_mode``); else fla's method runs.
    """
    cached = self._cos_cached
    if (
        torch.compiler.is_compiling()
        and cached is not None
        and seqlen <= self._seq_len_cached
        and cached.device == device
        and cached.dtype in (dtype, torch.float32)
    ):
        return
    return _fla_update_cos_sin_cache(self, seqlen, device, dtype)


def fill_caches(model, args) -> None:
    """A forward pre-hook of a model with compiled blocks: every rotary cache filled, in fp32, before the blocks
    run, as long as its attention will ask (the batch's length, ``args[0]``: tokens ``[B, T]`` or a pipeline
    stage's hidden states ``[B, T, D]``; at least the attention's ``max_position_embeddings``, as fla's
    Attention asks). Filled inside a compiled block, the cache changed between its first and second step, and
    dynamo compiled every attention block again at step 2 (its guard on the cache)."""
    tokens = args[0]
    for owner in model.modules():
        rotary = getattr(owner, "rotary", None)
        if isinstance(rotary, RotaryEmbedding):
            length = max(tokens.shape[1], getattr(owner, "max_position_embeddings", None) or 0)
            rotary._update_cos_sin_cache(length, device=tokens.device, dtype=torch.float32)


def rotate_at(x, cos, sin, positions, interleaved=False):
    """``x`` (``[B, T, H, D]``) rotated at per-token ``positions`` (``[B, T]``), e.g. a context-parallel
    rank's tokens at their places in the whole sequence; fla's torch reference, differentiable."""
    return rotary_embedding_ref(x, cos[positions], sin[positions], interleaved)


KERNELS = (
    Kernel("fla.modules.rotary.ops:rotary_embedding", rotary_embedding, TRITON),
    Kernel(
        "fla.modules.rotary.ops:RotaryEmbedding._update_cos_sin_cache", update_cos_sin_cache,
        "its cache check calls tensor.is_inference(), which dynamo cannot trace: a graph break in every "
        "compiled block on every step once the cache is filled",
        ("portable", "fla"),
    ),
)
"""What titan_ext's models call instead of fla's functions (``kernels.replacements``)."""

SIGNATURES = {
    "fla.modules.rotary.ops:rotary_embedding":
        "x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, chunk_indices=None",
    "fla.modules.rotary.ops:RotaryEmbedding._update_cos_sin_cache": "self, seqlen, device=None, dtype=None",
}
"""Parameters (``name=default``) of the functions replaced or called by keyword, as written against them
(``host.checks.check_fla_signatures``)."""
