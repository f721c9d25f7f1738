"""The planner's changes to torch and transformers, each inside its own blocks only (``scoped``): a step peak's
``with`` (``planner.memory.StepPeak``, through ``counting``) and a planned step's (``planner.rank``)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

from titan_ext.compat import resolve
from titan_ext.host.patches import TORCH, Patch, scoped

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
    """``_batch_p2p`` through the planner's pipelined rank being stepped (``planner.rank.schedule_p2p``, found by
    name: ``planner.rank`` imports this module for its rows, and importing it back would be a cycle)."""
    return functools.partial(resolve("titan_ext.planner.rank:schedule_p2p"), original)


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
    "schedule posts is tagged with its microbatch (planner.rank._Microbatches)",
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
    "1,024 ranks are without this rank), and half of a planned rank's mesh build was the bookkeeping of groups it is "
    "not in: on the planner's fake group such a group only takes its name (planner.rank.fake_group)",
    TORCH, _other_ranks_groups_named_only,
)
PLANNER: tuple[Patch, ...] = (STORAGE_RESIZES, SHAPE_INFERENCE, WHOLE_WINDOWS, SCHEDULES_ON_A_FAKE_GROUP, SCHEDULE_SENDS,
                               FAKE_CACHE_KEYS, FAKE_GROUPS_OF_OTHER_RANKS)
"""The planner's, each inside its own blocks only (``scoped``)."""

TABLES = (PLANNER,)


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
