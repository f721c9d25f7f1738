"""What the planner changes in torch (and in titan_ext's own CP attention) while it steps a rank: rows of the
host-patch machinery. The ``Patch`` rows last for one ``with`` block (``host_patches.scoped``); the
``InstancePatch`` rows change one schedule or stage the planner built for the rank, and end with it."""

from __future__ import annotations

import types

from titan_ext.host_patches import InstancePatch, Patch

CHECKED = "torch 2.13"
SCHEDULES = "torch.distributed.pipelining.schedules:_PipelineSchedule"
STAGE_BASE = "torch.distributed.pipelining.stage:_PipelineStageBase"
STAGE = "torch.distributed.pipelining.stage:PipelineStage"


def _kept(original):
    """The target as it was: restored as the block ends, whatever was set inside it."""
    return original


EXCEPTHOOK_KEPT = Patch(
    "sys:excepthook",
    "torch's init_process_group wraps sys.excepthook to prefix '[rankN]: ' to a traceback's lines; a sweep inits "
    "hundreds of fake groups in one process, and the wrappers stacked up on its error's every line: each planned "
    "rank's group leaves the hook as it found it (planner.rank.fake_group)",
    CHECKED, _kept,
)


class _Rows(list):
    """Rows of positions read as ``per_document_sdpa`` reads a tensor's (``.tolist()``)."""

    def tolist(self) -> list:
        return list(self)


def _whole_rows(original):
    """``per_document_sdpa`` with each row one document at the positions of this rank's pieces."""
    from titan_ext.kernels.state_passing import piece_order

    def planned(query, keys, values, layout, scale=None, window=None, dropout=0.0, sinks=None, softcap=None):
        size = query.shape[2] // layout.per_rank
        pieces = piece_order(layout.rank, layout.world, layout.per_rank)
        positions = [g for piece in pieces for g in range(piece * size, (piece + 1) * size)]
        rows = types.SimpleNamespace(positions=_Rows([positions] * query.shape[0]),
                                     document_positions=_Rows([list(range(keys.shape[2]))] * query.shape[0]))
        return original(query, keys, values, rows, scale, window, dropout, sinks, softcap)

    return planned


DOCUMENTS_AS_WHOLE_ROWS = Patch(
    "titan_ext.kernels.cp_attention:per_document_sdpa",
    "masked attention under CP (document masking, a sliding window) chooses its SDPA calls from the step's global "
    "positions and documents, which fake tensors do not hold; the fake batch holds whole windows, so each row is "
    "planned as one document at the positions of this rank's pieces (state_passing.piece_order): the calls a real "
    "step of whole windows makes (planner.rank)",
    "titan_ext", _whole_rows,
)

STAGE_CHUNKS_ATTRIBUTED = tuple(
    InstancePatch(
        f"{STAGE_BASE}.{name}",
        "a pipelined rank planned with fewer microbatches is extrapolated per microbatch: what a stage's forward "
        "or backward of a microbatch saves, allocates and issues is that microbatch's (planner.microbatches)",
        CHECKED,
    )
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
)
STAGE_P2P_OPS_STAMPED = tuple(
    InstancePatch(
        f"{STAGE_BASE}.{name}",
        "each send and receive a stage makes for a microbatch is stamped with it, and the buffers made with it are "
        "that microbatch's (planner.microbatches)",
        CHECKED,
    )
    for name in ("get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops", "get_bwd_send_ops")
)
SCHEDULE_LOSS_ATTRIBUTED = InstancePatch(
    f"{SCHEDULES}._maybe_compute_loss",
    "the loss the schedule computes for a microbatch, and what it keeps, is that microbatch's (planner.microbatches)",
    CHECKED,
)
SCHEDULE_STEP_ENDS_TOLD = InstancePatch(
    f"{SCHEDULES}._step_microbatches",
    "the step's peak is extrapolated from what is held once every microbatch is done: the planner notes that "
    "point (planner.microbatches)",
    CHECKED,
)
SCHEDULE_FIRST_MICROBATCH_KEPT = InstancePatch(
    f"{SCHEDULES}._step_microbatches",
    "the first step's setup messages are answered by the planner for the other ranks, from the first microbatch "
    "as the first stage gets it (planner.stages)",
    CHECKED,
)
SCHEDULE_VOTE_ANSWERED = InstancePatch(
    f"{SCHEDULES}._warmup_p2p",
    "the ranks' vote on whether every stage was given its shapes reads '.item()' of a fake group's tensor: the "
    "planner answers it as real runs decide it (none given: inferred; planner.stages)",
    CHECKED,
)
STAGE_META_SENT = InstancePatch(
    f"{STAGE}._send_meta",
    "on the fake group nothing arrives: what a stage sends the next one is kept for the rank planned after it "
    "(planner.stages)",
    CHECKED,
)
STAGE_META_RECEIVED = InstancePatch(
    f"{STAGE}._recv_meta",
    "on the fake group nothing arrives: the planner answers for the other ranks' stages, with what they compute "
    "from the microbatch or sent when planned before (planner.stages)",
    CHECKED,
)
SCHEDULE_SETUP_UNRECORDED = InstancePatch(
    f"{SCHEDULES}._initialize_pp_stages",
    "a real run sets its stages up in its first step only: the planner's one step records none of the setup, and "
    "answers its backward from the inputs (planner.stages)",
    CHECKED,
)

ROWS: tuple[Patch | InstancePatch, ...] = (
    EXCEPTHOOK_KEPT, DOCUMENTS_AS_WHOLE_ROWS, *STAGE_CHUNKS_ATTRIBUTED, *STAGE_P2P_OPS_STAMPED,
    SCHEDULE_LOSS_ATTRIBUTED, SCHEDULE_STEP_ENDS_TOLD, SCHEDULE_FIRST_MICROBATCH_KEPT, SCHEDULE_VOTE_ANSWERED,
    STAGE_META_SENT, STAGE_META_RECEIVED, SCHEDULE_SETUP_UNRECORDED,
)
"""Every row above (``tests/test_host_patches.py`` checks each target exists)."""
