"""The collectives a step issues, recorded as they reach the dispatcher (planned and real runs alike)."""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_ext import compat


@dataclass(frozen=True)
class Collective:
    kind: str
    """all_gather, reduce_scatter, all_reduce, broadcast, send, recv, all_to_all, barrier."""
    group: str
    """The mesh dimension(s) of its process group (torchtitan's names, e.g. ``fsdp``, ``tp``, ``pp``)."""
    ranks: int
    """Ranks in the group."""
    bytes: int
    """Bytes of the whole (unsharded) buffer: all-gather's output, reduce-scatter's input, all-reduce's
    tensor, a send's or receive's tensor."""

    def wire_bytes(self) -> float:
        """Bytes each rank sends in a bandwidth-optimal (ring) algorithm."""
        n = self.ranks
        if n <= 1:
            return 0.0
        share = {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_reduce": 2 * (n - 1) / n,
                 "all_to_all": (n - 1) / n, "recv": 0.0, "barrier": 0.0}
        return self.bytes * share.get(self.kind, 1.0)


KINDS = {
    "allgather": "all_gather", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
    "allreduce": "all_reduce", "all_reduce": "all_reduce", "broadcast": "broadcast", "send": "send",
    "recv": "recv", "alltoall": "all_to_all", "all_to_all": "all_to_all", "barrier": "barrier",
}

NOT_COLLECTIVES = {"wait_tensor", "wrap_tensor_autograd"}
"""Ops in the collective namespaces that move nothing (a wait; wrapping a functional collective's result)."""


def _kind(op_name: str) -> str | None:
    if not op_name.startswith(("c10d.", "_c10d_functional")):
        return None
    base = op_name.split(".")[1].strip("_")
    if base in NOT_COLLECTIVES:
        return None
    for key, kind in KINDS.items():
        if base.startswith(key):
            return kind
    return base


def _bytes(op_name: str, kind: str, args: list, ranks: int) -> int:
    """``Collective.bytes``. c10d's ops take (outputs, inputs): the larger is the whole buffer. A functional
    collective takes its input only and returns its output: an all-gather's whole buffer is its input times
    the group's ranks."""
    def size(value) -> int:
        return sum(t.numel() * t.element_size() for t in _tensors(value))

    if op_name.startswith("c10d."):
        return max(size(args[0]), size(args[1]) if len(args) > 1 else 0)
    return size(args[0]) * (ranks if kind == "all_gather" else 1)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _group(args) -> tuple[str, int]:
    for arg in args:
        if isinstance(arg, torch.ScriptObject) and arg._type().qualified_name().endswith("c10d.ProcessGroup"):
            arg = dist.ProcessGroup.unbox(arg)  # how c10d ops receive their group
        if isinstance(arg, dist.ProcessGroup):
            return arg.group_name, arg.size()
    names = [arg for arg in args if isinstance(arg, str)]
    if names:  # a functional collective: its group's name is its last string argument (after a reduce op's)
        pg = compat.resolve_process_group(names[-1])
        return pg.group_name, pg.size()
    return "?", 0


def group_labels(parallel_dims) -> dict[str, str]:
    """Process-group name -> the mesh dimensions it serves, e.g. ``{'3': 'batch+fsdp'}``."""
    names: dict[str, list[str]] = {}
    for dim, mesh in parallel_dims.get_all_one_dimensional_meshes().items():
        names.setdefault(mesh.get_group().group_name, []).append(dim)
    names.setdefault(dist.group.WORLD.group_name, []).append("world")
    return {group: "+".join(sorted(dims)) for group, dims in names.items()}


class Pausable:
    """A recorder that can look away: nothing inside ``paused()`` is recorded or counted (a planned pipeline
    stage's setup, which real runs do once)."""

    _paused = False

    @contextlib.contextmanager
    def paused(self):
        was, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = was


class Watcher(Pausable):
    """What sees every operator inside its ``with`` (a recorder, a step peak, an answer to ``.item()``): all
    watchers entered one inside the other share one torch dispatch mode, so an operator reaches Python once for
    all of them, not once for each: a planned rank's fake tensor mode (``watched_fake_tensors``), where they
    are entered right inside it, else a ``_Watch`` of their own. A subclass overrides what it needs:
    ``collective`` (before a collective runs), ``dispatched`` (after any operator ran), ``answers`` (operators
    it answers instead)."""

    answers: dict = {}
    """operator -> ``answer(args)``: what the operator returns, or ``NOT_ANSWERED`` to run it."""

    def collective(self, op_name: str, kind: str, args: list) -> None:
        """A collective of ``kind`` about to run; ``args``: its positional and keyword arguments."""

    def dispatched(self, args, kwargs, out) -> None:
        """An operator that ran on ``args`` and ``kwargs`` and returned ``out``."""

    def __enter__(self):
        mode = compat.current_dispatch_mode()
        if not isinstance(mode, _Watching):  # another mode in between: a mode of their own
            mode = _watch_mode()()
            mode.__enter__()
        mode.join(self)
        self._watch = mode
        return self

    def __exit__(self, *exc):
        mode, self._watch = self._watch, None
        if mode.leave(self):
            mode.__exit__(*exc)


NOT_ANSWERED = object()


class _Watching:
    """The watchers' work in a torch dispatch mode. Per operator: DTensor's go to DTensor first (what it runs on
    the local tensors comes back here), a collective is told to the recorders, an answered operator is
    answered, and what ran is told to those that watch every operator, each unless paused."""

    def _watchers_init(self) -> None:
        self.watchers: list[Watcher] = []
        self.recorders: list[Watcher] = []
        self.counters: list[Watcher] = []
        self.answers: dict = {}
        self._plans: dict[int, tuple] = {}
        """id(operator) -> (operator, its collective kind or None, its answer or None, whether the counters
        see it): what this mode does with it, decided at its first dispatch while the watchers stay the same."""

    def join(self, watcher: Watcher) -> None:
        self.watchers.append(watcher)
        self._sort()

    def leave(self, watcher: Watcher) -> bool:
        """Whether the mode's ``with`` ends (no watcher is left in a mode of their own)."""
        self.watchers.remove(watcher)
        self._sort()
        return not self.watchers

    def _sort(self) -> None:
        overrides = lambda name: [w for w in self.watchers if getattr(type(w), name) is not getattr(Watcher, name)]
        self.recorders, self.counters = overrides("collective"), overrides("dispatched")
        self.answers = {op: answer for w in self.watchers for op, answer in w.answers.items()}
        self._plans = {}

    def _plan(self, func) -> tuple:
        kind = _kind(str(func)) if self.recorders else None
        return func, kind, self.answers.get(func), bool(self.counters) and _may_return_tensors(func)

    def _watched(self, func, types, args, kwargs, run):
        """``run(func, types, args, kwargs)`` (the operator, on the next mode or fake tensors), watched."""
        if _with_dtensor(types):
            return NotImplemented
        plan = self._plans.get(id(func))
        if plan is None or plan[0] is not func:
            plan = self._plans[id(func)] = self._plan(func)
        _, kind, answer, counted = plan
        kwargs = kwargs or {}
        if kind is not None:
            for recorder in self.recorders:
                if not recorder._paused:
                    recorder.collective(str(func), kind, [*args, *kwargs.values()])
        out = answer(args) if answer is not None else NOT_ANSWERED
        if out is NOT_ANSWERED:
            out = run(func, types, args, kwargs)
        if counted:
            for counter in self.counters:
                if not counter._paused:
                    counter.dispatched(args, kwargs, out)
        return out


def _next_mode(func, types, args, kwargs):
    return func(*args, **kwargs)


@functools.cache
def _watch_mode() -> type:
    """``_Watch``: the watchers' own dispatch mode, a class made on first use (torch's ``TorchDispatchMode``,
    through ``compat``)."""

    class _Watch(_Watching, compat.torch_dispatch_mode()):
        def __init__(self):
            super().__init__()
            self._watchers_init()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return self._watched(func, types, args, kwargs, _next_mode)

    return _Watch


def watched_fake_tensors(**options):
    """A ``FakeTensorMode(**options)`` that is also the watchers' mode: the watchers entered right inside its
    ``with`` see each operator in its own dispatch, which then runs it on the fake tensors, so an operator
    reaches Python once, not once for the watchers and again for the fake tensors. A tensor's device asked from
    C++ (``prim.device``: half of a fake step's dispatches) and its other metadata are answered first, as
    ``FakeTensorMode`` answers them; what the fake mode runs inside its own dispatch (a decomposition's
    operators) reaches the fake mode only, as it does behind a ``_Watch``."""
    return _watched_fake_mode()(**options)


@functools.cache
def _watched_fake_mode() -> type:
    fake = compat.fake_tensor_mode()
    handlers = fake.metadata_handlers

    class _WatchedFake(_Watching, fake.FakeTensorMode):
        def __init__(self, **options):
            super().__init__(**options)
            self._watchers_init()
            self._inside = False
            self._outputs_made: dict = {}
            """device -> (its fake device, the attributes of a fake tensor made on it from the cache)"""

        def leave(self, watcher: Watcher) -> bool:
            super().leave(watcher)
            return False  # the fake tensors' own ``with`` ends it

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            handler = handlers.get(func)
            if self._inside or not self.watchers:  # FakeTensorMode's own dispatch, which answers these first too
                return handler(args) if handler is not None else self.dispatch(func, types, args, kwargs or {})
            if handler is not None and not _with_dtensor(types):
                return handler(args)
            self._inside = True  # what runs until it returns reaches the fake tensors only, as behind a _Watch
            try:
                return self._watched(func, types, args, kwargs, self._faked)
            finally:
                self._inside = False

        def _faked(self, func, types, args, kwargs):
            return self.dispatch(func, types, args, kwargs)

        if fake.outputs_from_cache_entries:
            def _get_output_tensor_from_cache_entry(self, state, entry, key, *func_args):
                """A fake tensor from a cache entry: as ``FakeTensorMode`` makes it, without its constructor's
                checks of arguments that are right here each time (a cache hit: most of a fake step's operators).
                ``func_args``: (func, args) in torch 2.11 and 2.13, (args,) in torch 2.15."""
                made = self._outputs_made.get(entry.metadata.device) if entry.metadata is not None else None
                if made is None or entry.inplace_idx is not None or self.shape_env is not None:
                    out = super()._get_output_tensor_from_cache_entry(state, entry, key, *func_args)
                    if (type(out) is fake.FakeTensor and entry.metadata is not None and entry.inplace_idx is None
                            and self.shape_env is None and not fake.debug()):  # a new tensor, as torch made it
                        self._outputs_made.setdefault(entry.metadata.device, (out.fake_device, dict(vars(out))))
                    return out
                return fake.output_from_metadata(self, entry, func_args[-1], *made)

    return _WatchedFake


_WITH_DTENSOR: dict[tuple, bool] = {}
"""The argument types an operator was dispatched with -> whether a DTensor is among them."""


def _with_dtensor(types) -> bool:
    dtensor = _WITH_DTENSOR.get(types)
    if dtensor is None:
        dtensor = _WITH_DTENSOR[types] = any(issubclass(t, DTensor) for t in types)
    return dtensor


def _may_return_tensors(func) -> bool:
    """Whether an operator's schema lets it return a tensor: most dispatches of a fake step ask a tensor's
    device or size (``prim.device``: C++ asks it of a fake tensor through the dispatcher), which allocate nothing."""
    schema = getattr(func, "_schema", None)

    def holds(kind) -> bool:
        return kind.kind() in ("TensorType", "AnyType") or any(holds(inner) for inner in kind.containedTypes())

    return schema is None or any(holds(ret.type) for ret in schema.returns)


class Recorder(Watcher):
    """Records every collective issued inside ``with recorder:``."""

    def __init__(self, labels: dict[str, str]):
        self.labels, self.log, self._paused = labels, [], False

    def collective(self, op_name: str, kind: str, args: list) -> None:
        self._record(op_name, kind, args)

    def _record(self, op_name: str, kind: str, args: list) -> None:
        group, ranks = _group(args)
        self.log.append(Collective(kind, self.labels.get(group, f"group {group}"), ranks, _bytes(op_name, kind, args, ranks)))


def summary(log: list[Collective]) -> list[tuple[str, str, int, int, int]]:
    """(kind, group, ranks, count, total bytes), sorted: what the tests compare and the CLI prints."""
    counts, totals = Counter(), Counter()
    for c in log:
        key = (c.kind, c.group, c.ranks)
        counts[key] += 1
        totals[key] += c.bytes
    return sorted((*key, counts[key], totals[key]) for key in counts)
