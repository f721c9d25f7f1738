"""The changes to DCP's writer and torchtitan's checkpointer behind a step's manifest and resuming past damage.

The implementations are the job's checkpoint checks' own (``titan_ext.inputs.checkpoints``): what they write
at a save is what they read at a resume.
"""

from __future__ import annotations

from titan_ext.host.patches import TORCH, TORCHTITAN, Patch


def _checkpoints(name: str):
    def new(original):
        from titan_ext.inputs import checkpoints

        return getattr(checkpoints, name)(original)

    return new


CHECKPOINT_MANIFEST: tuple[Patch, ...] = (
    Patch(
        "torch.distributed.checkpoint.filesystem:FileSystemWriter.write_data",
        "each rank records the size and CRC-32 of the files it wrote, as a piece of the step's manifest, while the "
        "page cache holds them (titan_ext.inputs.checkpoints.recording_checksums)",
        TORCH, _checkpoints("recording_checksums"),
    ),
    Patch(
        "torch.distributed.checkpoint.filesystem:FileSystemWriter.finish",
        "DCP records where each tensor lies in a step's files, not their sizes or checksums, so a shard changed "
        "within its size loads as garbage: rank 0, once every rank's files are written and before DCP writes "
        ".metadata, joins the ranks' pieces into the step's manifest (titan_ext.inputs.checkpoints); "
        "HF exports (their own writer's finish) are not changed",
        TORCH, _checkpoints("manifest_before_metadata"),
    ),
)
"""A job that saves DCP checkpoints (``--checkpoint.enable``)."""

SKIP_DAMAGED_STEPS: tuple[Patch, ...] = (
    Patch(
        "torchtitan.components.checkpoint:CheckpointManager._find_load_step",
        "torchtitan resumes from the newest step folder with a .metadata: with --titan_ext.damaged_checkpoint skip, "
        "from the newest whole one (titan_ext.inputs.checkpoints.newest_whole_step, the step the job's checks read)",
        TORCHTITAN, _checkpoints("newest_whole_step_finder"),
    ),
)
"""A job with ``--titan_ext.damaged_checkpoint skip``."""

TABLES = (CHECKPOINT_MANIFEST, SKIP_DAMAGED_STEPS)
