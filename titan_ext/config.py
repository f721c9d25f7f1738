"""The ``[titan_ext]`` TOML section.

Name this module in ``[job] custom_config_module = "titan_ext.config"`` to use
the section (and its ``--titan_ext.*`` flags); torchtitan merges this
``JobConfig`` into its own before the trainer starts.
"""

from dataclasses import dataclass, field


@dataclass
class TitanExt:
    hf_config: str = ""
    """Path to an HF ``config.json`` whose architecture fields override the
    flavor's (e.g. a checkpoint's own config). Its ``model_type`` must match
    the train spec."""

    disable_sequence_parallel: bool = False
    """With TP, keep activations between blocks replicated instead of
    sequence-sharded (2 all-reduces per block instead of 2 all-gathers and
    2 reduce-scatters). torchtitan has no flag for sequence parallelism."""

    nonfinite_loss: str = "stop"
    """What a NaN/Inf loss does: "stop" the job before that step's update and
    checkpoint, "skip" the step's update, or "off" (no check, no per-step sync)."""

    metrics_jsonl: str = ""
    """If set, rank 0 appends every logged step's metrics, at full precision,
    to this JSON-lines file (the console rounds them)."""


@dataclass
class JobConfig:
    titan_ext: TitanExt = field(default_factory=TitanExt)
