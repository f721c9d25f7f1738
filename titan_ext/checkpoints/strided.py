"""DCP for DTensors laid out with a ``_StridedShard`` that no later placement refines.

Splitting each expert's packed ``gate_up_proj`` (``[E, 2I, H]``, rows ``[gate; up]``) over TP gives rank r gate rows r
and up rows r (``titan_ext.parallel.expert_parallel.apply_expert_tp``): a ``_StridedShard(1, split_factor=2)``, exact
for the full tensor and every redistribution, but not one box of the global tensor, and DCP (torch 2.11-2.15) describes
each rank's shard of a DTensor as one box: it saves such a parameter, and its optimizer states, as overlapping chunks
("has overlapping chunks"). Here such a DTensor is described as boxes of its local rows (one per piece and leading
index: contiguous views, read and written in place), the checkpoint the full ``[E, 2I, H]`` tensor as one process saves
it. Any other DTensor is left to torch (``checkpoints.host_patches.STRIDED_CHECKPOINT``).

torch's safetensors writer (HF exports) names each rank's chunks by the tensor's name, one chunk per rank: for an
HF export or import such a tensor is handed over with one box per rank (``one_box``, its strided shard moved to
dim 0) and laid out again after an import (``laid_out_as``), one tensor at a time.
"""

from __future__ import annotations

import itertools

import torch

from titan_ext import compat


def _layout(tensor) -> tuple | None:
    """(dim d, split factor, the view's shape, this rank's offsets in the view, the local view) for a DTensor with
    a ``_StridedShard`` of dim d that no later placement shards again; None for any other layout."""
    placements = tensor.placements
    for i, placement in enumerate(placements):
        if not compat.is_strided_shard(placement):
            continue
        dim = placement.dim
        if any(compat.is_shard(later) and later.dim == dim for later in placements[i + 1:]):
            continue  # FSDP over TP on one dim: torch's own case
        factor = placement.split_factor
        shape = tuple(tensor.shape)
        view = shape[:dim] + (factor, shape[dim] // factor) + shape[dim + 1:]
        mapped = [compat.shard_on_view(p, dim, p is placement) for p in placements]
        sizes, offsets = compat.dtensor_local_box(view, tensor.device_mesh, mapped)
        local = tensor._local_tensor.view(sizes)
        return dim, factor, view, offsets, local
    return None


def boxes(tensor) -> dict[torch.Size, torch.Tensor] | None:
    """Global offsets -> this rank's contiguous view there (None: torch's layout)."""
    layout = _layout(tensor)
    if layout is None:
        return None
    dim, factor, view, offsets, local = layout
    found = {}
    for lead in itertools.product(*(range(n) for n in local.shape[:dim])):
        for piece in range(factor):
            at = [offsets[k] + lead[k] for k in range(dim)] + [piece * view[dim + 1] + offsets[dim + 1]]
            found[torch.Size(at + list(offsets[dim + 2:]))] = _box(local, lead, piece)
    return found


def _box(local: torch.Tensor, lead: tuple, piece: int) -> torch.Tensor:
    part = local[lead + (piece,)]
    return part.view((1,) * len(lead) + tuple(part.shape))


def shard_at(tensor, offset) -> torch.Tensor | None:
    layout = _layout(tensor)
    if layout is None:
        return None
    dim, factor, view, offsets, local = layout
    lead = tuple(offset[k] - offsets[k] for k in range(dim))
    return _box(local, lead, offset[dim] // view[dim + 1])


def create_write_items(original):
    def __create_write_items__(self, fqn, obj):
        found = boxes(self)
        if found is None:
            return original(self, fqn, obj)
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, at), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=at, sizes=box.shape),
                                                      properties=TensorProperties.create_from_tensor(box),
                                                      size=self.shape))
                for at, box in found.items()]

    return __create_write_items__


def create_chunk_list(original):
    def __create_chunk_list__(self):
        found = boxes(self)
        if found is None:
            return original(self)
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=at, sizes=box.shape) for at, box in found.items()]

    return __create_chunk_list__


def get_tensor_shard(original):
    def __get_tensor_shard__(self, index):
        box = shard_at(self, index.offset) if index.offset is not None else None
        return original(self, index) if box is None else box

    return __get_tensor_shard__


def is_strided(value) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor) and _layout(value) is not None


def one_box(value):
    """``value`` (``is_strided``) with one box per rank: its strided mesh dim shards dim 0 instead (its full
    tensor gathered once, transiently)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    dim = _layout(value)[0]
    placements = [Shard(0) if compat.is_strided_shard(p) and p.dim == dim else p for p in value.placements]
    return distribute_tensor(value.full_tensor(), value.device_mesh, placements)


def laid_out_as(value, like):
    """``value`` (as ``one_box`` hands it over) in ``like``'s layout."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.full_tensor(), like.device_mesh, like.placements)
