"""The ``[titan_ext]`` TOML section.

Name this module in ``[job] custom_config_module = "titan_ext.config"`` to use
the section (and its ``--titan_ext.*`` flags); torchtitan merges this
``JobConfig`` into its own before the trainer starts.
"""

import sys
from dataclasses import dataclass, field

from titan_ext import compat


@dataclass
class TitanExt:
    hf_config: str = ""
    """Path to an HF ``config.json`` (or a directory holding one). Its
    architecture fields override the flavor's (e.g. a checkpoint's own
    config), and its ``model_type`` must match a named flavor's; for the
    generic specs (``fla``, ``hf``) without a named flavor it is the whole
    architecture."""

    disable_sequence_parallel: bool = False
    """With TP, keep activations between blocks replicated instead of
    sequence-sharded (2 all-reduces per block instead of 2 all-gathers and
    2 reduce-scatters). torchtitan has no flag for sequence parallelism."""

    nonfinite_loss: str = "stop"
    """What a NaN/Inf loss does: "stop" the job before that step's update and
    checkpoint, "skip" the step's update, or "off" (no check, no per-step sync)."""

    text_field: str = "text"
    """The record field holding the text, for ``dataset = "titan_ext_stream"``."""

    shuffle_buffer: int = 10000
    """Documents in the seeded shuffle buffer of ``dataset = "titan_ext_stream"`` (0: stream order).
    The buffer is part of the checkpoint, so a resumed run sees the same documents."""

    bad_records: str = "stop"
    """A record ``titan_ext_stream`` cannot train on (a JSON-lines line that is not JSON, a record without the
    text field): "stop" the job in one line naming the file and line, or "skip" it (each logged, counted)."""

    document_mask: bool = False
    """Train each packed window as its separate documents: attention and
    recurrent state stay inside a document, positions restart, no label
    crosses a boundary (``titan_ext.data.documents``). Needs dataset
    ``titan_ext_stream`` or ``titan_ext_tiny``."""

    kernels: str = "auto"
    """Which kernels titan_ext's fla models run: "auto" (fla's Triton kernels on CUDA, titan_ext's portable
    torch kernels on the CPU), "fla" (fla's kernels as shipped; on the CPU under Triton's interpreter,
    TRITON_INTERPRET=1) or "portable" (torch kernels anywhere, e.g. to bisect a kernel problem on a GPU)."""

    loss: str = "full"
    """The training loss: "full" (torchtitan's cross-entropy over the whole ``[batch, seq, vocab]`` logits) or
    "chunked" (the output head and the loss over chunks of tokens: one chunk's logits at a time, forward and
    backward; same result to fp32 rounding; ``titan_ext.models.loss``)."""

    loss_chunk_tokens: int = 0
    """Tokens per chunk of the chunked loss; 0: as many as keep a chunk's fp32 logits within 128 MiB
    (on this rank's vocabulary slice under TP)."""

    moe_balance: str = "aux_loss"
    """How a mixture-of-experts model keeps its experts evenly used: "aux_loss" (the router's balancing loss times
    the config's ``router_aux_loss_coef``, as transformers trains it) or "bias" (torchtitan's auxiliary-loss-free
    balancing: a per-expert bias added to the router's scores to choose the top-k experts, moved by 1e-3 toward
    even use after each optimizer step from the tokens each expert got over the global batch)."""

    damaged_checkpoint: str = "stop"
    """What resuming does when the step it would load is damaged (a file missing, cut short, or changed since the
    save, found before the model is built): "stop" in one line naming the step, the file and the older steps to
    give ``--checkpoint.load_step``, or "skip" to the newest whole step, with one WARNING naming the damaged one.
    Nothing on disk changes either way. A step asked for by ``--checkpoint.load_step`` always stops."""

    log_every_rank: bool = False
    """Every rank prints its INFO lines and step line, as torchtitan does; by default ranks other than 0 print
    only warnings and errors, and the step line comes from the rank holding the loss (``titan_ext.host.progress``)."""

    metrics_jsonl: str = ""
    """If set, rank 0 appends every logged step's metrics, at full precision,
    to this JSON-lines file (the console rounds them)."""


@dataclass
class TitanExtJobConfig:
    titan_ext: TitanExt = field(default_factory=TitanExt)


def __getattr__(name: str):
    """``JobConfig``: what torchtitan's ConfigManager reads from ``custom_config_module``.

    torchtitan reads it while parsing, before its Trainer exists, right after
    importing this module and so the titan_ext package. The package is then
    forgotten, so that the Trainer's own import of it (``custom_import``)
    runs ``titan_ext/__init__.py`` again and sets up the job: a cached module
    would run nothing.
    """
    if name != "JobConfig":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if compat.parsing_torchtitan_config():
        sys.modules.pop("titan_ext", None)
    return TitanExtJobConfig

