"""fla's rotary embedding off CUDA, through fla's own torch reference."""

import torch
from fla.modules.rotary.ops import RotaryEmbedding, rotary_embedding_ref

_fla_update_cos_sin_cache = vars(RotaryEmbedding)["_update_cos_sin_cache"]


def rotary_embedding(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, chunk_indices=None):
    """fla's ``rotary_embedding`` for one shared integer offset, through fla's torch reference."""
    if cu_seqlens is not None or not isinstance(seqlen_offsets, int):
        raise ValueError("rotary embeddings off CUDA support one integer offset, not cu_seqlens or per-sequence offsets")
    length = x.shape[1]
    positions = slice(seqlen_offsets, seqlen_offsets + length)
    return rotary_embedding_ref(x, cos[positions], sin[positions], interleaved)


def update_cos_sin_cache(self, seqlen, device=None, dtype=None):
    """fla's ``RotaryEmbedding._update_cos_sin_cache``, minus a graph break inside compiled blocks.

    fla's check ends with ``self._cos_cached.is_inference()``, which dynamo
    cannot trace: once the cache is filled, every call from a compiled block
    would break the graph there (5 graphs per block instead of 1). Under
    compile, a cache of the right length, device and dtype is used as is
    (titan_ext never fills it under ``inference_mode``); else fla's method runs.
    """
    cached = self._cos_cached
    if (
        torch.compiler.is_compiling()
        and cached is not None
        and seqlen <= self._seq_len_cached
        and cached.device == device
        and cached.dtype == dtype
    ):
        return
    return _fla_update_cos_sin_cache(self, seqlen, device, dtype)
