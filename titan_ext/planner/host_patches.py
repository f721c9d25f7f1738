"""The planner's changes to torch and transformers (and to titan_ext's own CP attention), each inside its own
blocks only: a step peak's ``with`` (``planner.memory.StepPeak``, through ``counting``), a planned step's
(``planner.rank``), and the schedule and stages the planner builds for a pipelined rank (``STEPPING``)."""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator

from titan_ext.compat import resolve
from titan_ext.patching import TORCH, InstancePatch, Patch, scoped

_COUNTING: list = []
"""The step peaks inside their ``with`` (``counting``)."""


def _resizes_told(original):
    """``resize_`` that then tells the step peaks inside their ``with``."""

    def resize_(storage, size):
        out = original(storage, size)
        for peak in _COUNTING:
            peak.resized(storage)
        return out

    return resize_


@contextlib.contextmanager
def _uncounted() -> Iterator[None]:
    """Allocations the step peaks inside their ``with`` do not count."""
    with contextlib.ExitStack() as stack:
        for peak in _COUNTING:
            stack.enter_context(peak.paused())
        yield


def _shapes_inferred_uncounted(original):
    """DTensor's shape inference with the step peaks looking away: on fake tensors, it holds no memory."""

    def infer(self, op_schema):
        with _uncounted():
            return original(self, op_schema)

    return infer


def _no_packed_sequences(_original):
    return lambda position_ids: None


STORAGE_RESIZES = Patch(
    "torch:UntypedStorage.resize_",
    "FSDP frees a gathered weight's memory by resizing its storage to 0 and gathers into it again by resizing it "
    "back, which no operator dispatch sees: the step's peak (planner.memory.StepPeak, planned and real steps "
    "alike) follows each resize",
    TORCH, _resizes_told,
)
SHAPE_INFERENCE = Patch(
    "torch.distributed.tensor._sharding_prop:ShardingPropagator._propagate_tensor_meta_non_cached",
    "DTensor infers an op's global output shape by running the op on fake tensors of the global shapes, where its "
    "cache does not know the op's inputs yet: no memory, but the step's peak (planner.memory.StepPeak) would count "
    "them (under TP an embedding's whole-vocabulary gradient, twice). A real run's step 2 finds its cache filled "
    "by step 1; the planner's one step (a first one) does not: it counted 1.15-1.5x a TP rank's real peak",
    TORCH, _shapes_inferred_uncounted,
)
WHOLE_WINDOWS = Patch(
    "transformers.masking_utils:find_packed_sequence_indices",
    "the planner's fake batch holds whole windows, no packed documents: transformers finds none in a real batch's "
    "position ids and skips its T x T mask for SDPA's causal flag; on fake tensors it cannot read them and would "
    "build the mask (8192 tokens: 256 MiB per layer) that the real step never holds (planner.rank)",
    "transformers 5.17-5.24", _no_packed_sequences,
)


def _fake_group_read_as_gloo(original):
    """``torch.distributed`` as the schedules module reads it, with a fake group's backend answered as gloo's."""

    class RealLooking:
        def __getattr__(self, name):
            return getattr(original, name)

        @staticmethod
        def get_backend(group=None):
            backend = original.get_backend(group)
            return "gloo" if backend == "fake" else backend

    return RealLooking()


def _sends_told(original):
    """``_batch_p2p`` through the planner's pipelined rank being stepped (``planner.microbatches.schedule_p2p``, found by
    name: ``planner.microbatches`` imports this module for its rows, and importing it back would be a cycle)."""
    return functools.partial(resolve("titan_ext.planner.microbatches:schedule_p2p"), original)


SCHEDULES_ON_A_FAKE_GROUP = Patch(
    "torch.distributed.pipelining.schedules:dist",
    "torch >= 2.15 refuses to build or first step a schedule whose stages infer their shapes on a fake group (its "
    "own dry runs cannot answer the shape messages); the planner answers them, so while it plans a rank the "
    "schedules module reads the fake group's backend as gloo's (planner.rank)",
    TORCH, _fake_group_read_as_gloo,
)
SCHEDULE_SENDS = Patch(
    "torch.distributed.pipelining.schedules:_batch_p2p",
    "a pipelined rank planned with fewer microbatches is extrapolated per microbatch: each send and receive the "
    "schedule posts is tagged with its microbatch (planner.microbatches.Microbatches)",
    TORCH, _sends_told,
)


class _FakeTensorKey:
    """Marks a fake tensor's metadata in a fake-op cache key made by ``_compact_fake_cache_keys`` (no key torch
    makes holds it, so the two kinds never match)."""


def _compact_fake_cache_keys(original):
    """``FakeTensorMode``'s cache key with each fake tensor's metadata as one tuple: what torch's key holds
    (dtype, shape, strides, device, storage offset and bytes, requires_grad, the quantized, conjugate, negative
    and inference flags; its memory format follows from the shape and strides), made in a fraction of the time
    torch takes to flatten a dataclass of it field by field. Anything else (a dict, a symbolic shape, a sparse
    tensor, another mode's tensor, a value of another type) is keyed, or refused, by torch's own code."""
    import inspect

    import torch

    from titan_ext import compat

    if list(inspect.signature(original).parameters) != ["self", "result", "args", "state", "id_hashed_objects"]:
        return original  # another torch's key builder, which this one calls: left as it is
    fake, strided = compat.fake_process_group().FakeTensor, torch.strided
    plain = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)

    def prep_args_for_hash(mode, result, args, state, id_hashed_objects):
        if isinstance(args, dict):
            return original(mode, result, args, state, id_hashed_objects)
        if isinstance(args, (list, tuple)):
            result += (type(args), len(args))
        for arg in args:
            kind = type(arg)
            if (kind is fake and arg.fake_mode is mode and arg.constant is None and arg.layout is strided
                    and not arg._has_symbolic_sizes_strides):
                result += (_FakeTensorKey, (arg.dtype, arg.shape, arg.stride(), arg.device, arg.storage_offset(),
                                            arg.untyped_storage().nbytes(), arg.requires_grad, arg.is_quantized,
                                            arg.is_conj(), arg.is_neg(), arg.is_inference()))
            elif kind in plain:
                result += (kind, arg)
            elif kind in (list, tuple, torch.Size):
                prep_args_for_hash(mode, result, arg, state, id_hashed_objects)
            else:
                original(mode, result, (arg,), state, id_hashed_objects)

    return prep_args_for_hash


FAKE_CACHE_KEYS = Patch(
    "torch._subclasses.fake_tensor:FakeTensorMode._prep_args_for_hash",
    "a planned step is one fake operator after another, nearly all answered from FakeTensorMode's cache, and torch "
    "spent half of each answer building its key field by field: the planner keys each fake tensor by the same "
    "metadata in one tuple (planner.rank)",
    TORCH, _compact_fake_cache_keys,
)


def _other_ranks_groups_named_only(original):
    """``new_group`` on the fake backend for a group without this rank: only the name it takes (the next
    number, which the groups after it count on), and the non-member marker ``new_group`` returns. torch
    registers nothing else for it, and on a real backend, or with a hashed name, it is called as shipped."""
    import inspect

    from titan_ext import compat

    expected = ["ranks", "timeout", "backend", "backend_options", "pg_tag", "use_local_synchronization", "group_desc",
                "device_id", "sort_ranks"]
    if list(inspect.signature(original).parameters) != expected:
        return original  # another torch's, whose arguments this does not know: left as it is
    c10d = compat.c10d_groups()
    world: list = [None, None]
    """[the default group last seen, its rank where it is fake and without a barrier after each group, else None]"""

    def new_group_with_tag(ranks=None, timeout=None, backend=None, backend_options=None, pg_tag=None,
                           use_local_synchronization=False, group_desc=None, device_id=None, sort_ranks=True):
        default = c10d.default_group()
        if world[0] is not default:
            fake = c10d.backend_of(default) == "fake" and not c10d.barrier_after_init()
            world[:] = [default, default.rank() if fake else None]
        if ranks is None or use_local_synchronization or world[1] is None or world[1] in ranks:
            return original(ranks, timeout, backend, backend_options, pg_tag, use_local_synchronization, group_desc,
                            device_id, sort_ranks)
        c10d.group_name(sorted(ranks) if sort_ranks else ranks)
        return c10d.non_member

    return new_group_with_tag


FAKE_GROUPS_OF_OTHER_RANKS = Patch(
    "torch.distributed.distributed_c10d:_new_group_with_tag",
    "a device mesh makes every subgroup of every dimension on every rank (511 of a dimension of 2's 512 groups at "
    "1,024 ranks are without this rank), and the bookkeeping of groups it is not in is much of a planned rank's "
    "mesh build: on the planner's fake group such a group only takes its name (planner.rank.fake_group)",
    TORCH, _other_ranks_groups_named_only,
)
PLANNER: tuple[Patch, ...] = (STORAGE_RESIZES, SHAPE_INFERENCE, WHOLE_WINDOWS, SCHEDULES_ON_A_FAKE_GROUP, SCHEDULE_SENDS,
                               FAKE_CACHE_KEYS, FAKE_GROUPS_OF_OTHER_RANKS)
"""The planner's, each inside its own blocks only (``scoped``)."""


# ---- the schedule and stages of a pipelined rank, and its step ----

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

STEPPING: tuple[Patch | InstancePatch, ...] = (
    EXCEPTHOOK_KEPT, DOCUMENTS_AS_WHOLE_ROWS, *STAGE_CHUNKS_ATTRIBUTED, *STAGE_P2P_OPS_STAMPED,
    SCHEDULE_LOSS_ATTRIBUTED, SCHEDULE_STEP_ENDS_TOLD, SCHEDULE_FIRST_MICROBATCH_KEPT, SCHEDULE_VOTE_ANSWERED,
    STAGE_META_SENT, STAGE_META_RECEIVED, SCHEDULE_SETUP_UNRECORDED,
)
"""While the planner steps a rank: the ``Patch`` rows for one ``with`` block (``scoped``), the ``InstancePatch``
rows on one schedule or stage the planner built for the rank, ending with it."""

TABLES = (PLANNER, STEPPING)


@contextlib.contextmanager
def counting(peak) -> Iterator[None]:
    """``peak`` told of each storage resize and paused while DTensor infers shapes, for one ``with``
    (``STORAGE_RESIZES``, ``SHAPE_INFERENCE``); ``peak`` has ``resized(storage)`` and ``paused()``."""
    with scoped((STORAGE_RESIZES, SHAPE_INFERENCE)):
        _COUNTING.append(peak)
        try:
            yield
        finally:
            _COUNTING.remove(peak)
