"""The change to DTensor's checkpoint methods that saves a strided shard as boxes of the full tensor."""

from __future__ import annotations

from titan_ext.host.patches import TORCH, Patch, apply_once  # noqa: F401  (apply_once: this table's callers)


def _strided_checkpoint(name: str):
    def new(original):
        from titan_ext import strided_checkpoint

        return getattr(strided_checkpoint, name)(original)

    return new


STRIDED_CHECKPOINT: tuple[Patch, ...] = tuple(
    Patch(
        f"torch.distributed.tensor:DTensor.{method}",
        "DCP describes each rank's shard of a DTensor as one box, which a _StridedShard that no later placement "
        "refines is not (each expert's [gate; up] rows split over TP): saved as overlapping chunks. Such a "
        "DTensor's local rows become boxes of the full tensor; any other DTensor as torch has it "
        "(titan_ext.strided_checkpoint)",
        TORCH, _strided_checkpoint(replacement),
    )
    for method, replacement in (("__create_write_items__", "create_write_items"),
                                ("__create_chunk_list__", "create_chunk_list"),
                                ("__get_tensor_shard__", "get_tensor_shard"))
)
"""A job that splits its experts' intermediate dims over TP (``titan_ext.parallel.expert_parallel.apply_expert_tp``)."""

TABLES = (STRIDED_CHECKPOINT,)
