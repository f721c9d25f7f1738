"""The changes to torch's DCP and torchtitan's checkpointer: a step's manifest and resuming past damage (the
implementations are the DCP step checks' own, ``dcp_steps``: what they write at a save is what they read at a
resume), and DTensor's checkpoint methods saving a strided shard as boxes of the full tensor (``strided``)."""

from __future__ import annotations

from titan_ext.patching import TORCH, TORCHTITAN, Patch



def _checkpoints(name: str):
    def new(original):
        from titan_ext.checkpoints import dcp_steps

        return getattr(dcp_steps, name)(original)

    return new


CHECKPOINT_MANIFEST: tuple[Patch, ...] = (
    Patch(
        "torch.distributed.checkpoint.filesystem:FileSystemWriter.write_data",
        "each rank records the size and CRC-32 of the files it wrote, as a piece of the step's manifest, while the "
        "page cache holds them (titan_ext.checkpoints.dcp_steps.recording_checksums)",
        TORCH, _checkpoints("recording_checksums"),
    ),
    Patch(
        "torch.distributed.checkpoint.filesystem:FileSystemWriter.finish",
        "DCP records where each tensor lies in a step's files, not their sizes or checksums, so a shard changed "
        "within its size loads as garbage: rank 0, once every rank's files are written and before DCP writes "
        ".metadata, joins the ranks' pieces into the step's manifest (titan_ext.checkpoints.dcp_steps); "
        "HF exports (their own writer's finish) are not changed",
        TORCH, _checkpoints("manifest_before_metadata"),
    ),
)
"""A job that saves DCP checkpoints (``--checkpoint.enable``)."""

SKIP_DAMAGED_STEPS: tuple[Patch, ...] = (
    Patch(
        "torchtitan.components.checkpoint:CheckpointManager._find_load_step",
        "torchtitan resumes from the newest step folder with a .metadata: with --titan_ext.damaged_checkpoint skip, "
        "from the newest whole one (titan_ext.checkpoints.dcp_steps.newest_whole_step, the step the job's checks read)",
        TORCHTITAN, _checkpoints("newest_whole_step_finder"),
    ),
)
"""A job with ``--titan_ext.damaged_checkpoint skip``."""


def _strided_checkpoint(name: str):
    def new(original):
        from titan_ext.checkpoints import strided

        return getattr(strided, name)(original)

    return new


STRIDED_CHECKPOINT: tuple[Patch, ...] = tuple(
    Patch(
        f"torch.distributed.tensor:DTensor.{method}",
        "DCP describes each rank's shard of a DTensor as one box, which a _StridedShard that no later placement "
        "refines is not (each expert's [gate; up] rows split over TP): saved as overlapping chunks. Such a "
        "DTensor's local rows become boxes of the full tensor; any other DTensor as torch has it "
        "(titan_ext.checkpoints.strided)",
        TORCH, _strided_checkpoint(replacement),
    )
    for method, replacement in (("__create_write_items__", "create_write_items"),
                                ("__create_chunk_list__", "create_chunk_list"),
                                ("__get_tensor_shard__", "get_tensor_shard"))
)
"""A job that splits its experts' intermediate dims over TP (``titan_ext.parallel.expert_parallel.apply_expert_tp``)."""

TABLES = (CHECKPOINT_MANIFEST, SKIP_DAMAGED_STEPS, STRIDED_CHECKPOINT)
