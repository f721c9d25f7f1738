"""The collectives a step issues, recorded as they reach the dispatcher (planned and real runs alike)."""

from __future__ import annotations

import contextlib
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
        self._paused = True
        try:
            yield
        finally:
            self._paused = False


class Recorder(Pausable):
    """Records every collective issued inside ``with recorder:`` (a torch dispatch mode)."""

    def __init__(self, labels: dict[str, str]):
        self.labels, self.log, self._paused = labels, [], False
        recorder = self

        class Mode(compat.torch_dispatch_mode()):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if any(issubclass(t, DTensor) for t in types):
                    return NotImplemented  # DTensor first: what it issues inside (torch's ring attention) comes back here
                kwargs = kwargs or {}
                kind = None if recorder._paused else _kind(str(func))
                if kind is not None:
                    recorder._record(str(func), kind, list(args) + list(kwargs.values()))
                return func(*args, **kwargs)

        self._mode = Mode()

    def _record(self, op_name: str, kind: str, args: list) -> None:
        group, ranks = _group(args)
        self.log.append(Collective(kind, self.labels.get(group, f"group {group}"), ranks, _bytes(op_name, kind, args, ranks)))

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def summary(log: list[Collective]) -> list[tuple[str, str, int, int, int]]:
    """(kind, group, ranks, count, total bytes), sorted: what the tests compare and the CLI prints."""
    counts, totals = Counter(), Counter()
    for c in log:
        key = (c.kind, c.group, c.ranks)
        counts[key] += 1
        totals[key] += c.bytes
    return sorted((*key, counts[key], totals[key]) for key in counts)
