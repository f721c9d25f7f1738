"""fla's rotary embedding off CUDA, through fla's own torch reference."""

from fla.modules.rotary.ops import rotary_embedding_ref


def rotary_embedding(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, chunk_indices=None):
    """fla's ``rotary_embedding`` for one shared integer offset, through fla's torch reference."""
    if cu_seqlens is not None or not isinstance(seqlen_offsets, int):
        raise ValueError("rotary embeddings off CUDA support one integer offset, not cu_seqlens or per-sequence offsets")
    length = x.shape[1]
    positions = slice(seqlen_offsets, seqlen_offsets + length)
    return rotary_embedding_ref(x, cos[positions], sin[positions], interleaved)
