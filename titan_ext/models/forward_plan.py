"""How one model instance runs its forward under the job's features, decided once per model (or pipeline stage).

Features depend on each other's choices (the chunked loss's head, TP's residual layout, CP's piece layout,
per-document attention), so ``parallelize_fn`` decides them together, from the job plan and the meshes, before
any feature is applied (``decide_forward``), and no feature signals another through a flag on the model: the
features apply what the record says, and the forward (``TitanCausalLM.forward``,
``models.packing``) and the hooks on it read it from one attribute, ``model.forward_plan``. Whether the model
takes hidden states (a pipeline stage after the first) is what it holds: ``Structure.takes_hidden_states``.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_ext.job_plan import JobPlan


@dataclass(frozen=True)
class ForwardPlan:
    """A model no job parallelized (a test's, a benchmark's) runs the default: logits out, a block-causal
    mask for packed documents, one process."""

    head_in_loss: bool = False
    """The chunked loss (``titan_ext.models.loss``): the forward returns the final hidden states, and the loss runs the
    head over them in chunks."""
    document_attention: bool = False
    """Document masking on a transformers model outside CP: its attention runs each document alone, from
    ``cu_seqlens`` (``titan_ext.data.documents.apply_document_attention``); else it takes a block-causal mask."""
    residual_layout: tuple | None = None
    """TP with sequence parallel: (mesh, placements) of the residual stream. A pipeline stage sends and receives
    its local shard and rewraps it, since HF decoders read the global sequence length from their input's shape."""
    cp_layout: object | None = None
    """Context parallelism: this rank's place in the split sequences (``kernels.state_passing.PieceLayout``),
    where each step's positions are recorded for the bound mixers."""


def decide_forward(model, plan: JobPlan, tp_mesh=None, cp_mesh=None) -> ForwardPlan:
    """The forward of ``model`` (built from the plan's args) under ``plan``; ``tp_mesh``/``cp_mesh``: the job's,
    where it has TP or CP."""
    from torch.distributed.tensor import Shard

    from titan_ext.kernels.state_passing import PieceLayout

    sequence_parallel = plan.tp is not None and plan.tp.sequence_parallel
    return ForwardPlan(
        head_in_loss=plan.loss is not None,
        # under CP the attention masks documents itself; fla models take cu_seqlens already
        document_attention=plan.document_mask and plan.cp is None and model.arch.packed_layout != "cu_seqlens",
        residual_layout=(tp_mesh, (Shard(1),)) if sequence_parallel else None,
        cp_layout=PieceLayout(cp_mesh.get_group(), plan.cp.pieces_per_rank) if plan.cp is not None else None,
    )
